package sim

// The election simulation (issue 15): candidates campaign for one name
// with package election, over the memory backend and the fault wrapper,
// inside one testing/synctest bubble, driven by one goroutine with a
// seeded RNG, as Run drives the lock clients (see sim.go for why that is
// deterministic). ElectCheck (elect_check.go) checks what it records.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing/synctest"
	"time"

	"github.com/ashlock/ashlock/election"
	"github.com/ashlock/ashlock/internal/testkit/faultbackend"
	"github.com/ashlock/ashlock/internal/testkit/history"
	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

// The election simulation's own fault kinds (the wrapper counts the
// per-call ones; Crash and Pause are the lock simulation's).
const (
	// Restart stops a candidate's process gracefully (its context ends:
	// Run returns, the leader's function returns, the term is resigned)
	// and starts it again later.
	Restart faultbackend.Kind = "restart"
	// StaleRead makes an observer's read return an older state of the
	// election, as a lagging replica or cache would.
	StaleRead faultbackend.Kind = "stale_read"
	// ReadError makes an observer's read fail.
	ReadError faultbackend.Kind = "read_error"
)

// ElectKinds are the fault kinds a seed of the election simulation may
// activate, each with probability 1/2.
var ElectKinds = []faultbackend.Kind{
	faultbackend.FailBefore, faultbackend.FailAfter, faultbackend.Delay, faultbackend.Hang,
	faultbackend.ClockJump, Crash, Pause, Restart, StaleRead,
}

// ElectionName is the simulated election's name.
const ElectionName = "leader"

// Candidates use Election.Run or Campaign and Resign directly.
const (
	ModeRun      = "run"
	ModeCampaign = "campaign"
)

// ElectReleaseTimeout is the candidates' sqllock.Options.ReleaseTimeout.
const ElectReleaseTimeout = time.Second

// ElectBackoff is the candidates' election.Config.Backoff: deterministic
// and stateless, 20ms·2^(attempt-1) capped at 320ms, plus a few µs that
// keep retries off other timers' instants.
func ElectBackoff(attempt int) time.Duration {
	d := 20 * time.Millisecond << min(max(attempt-1, 0), 4)
	return d + time.Duration(attempt%89)*6007*time.Nanosecond
}

// ElectBackoffMax bounds ElectBackoff.
const ElectBackoffMax = 320*time.Millisecond + 89*6007*time.Nanosecond

// ElectConfig is one run of the election simulation.
type ElectConfig struct {
	Seed  uint64
	Steps int // driver steps; default 150
}

// Incarnation is one process of a candidate: its client in the lock
// history (Client), its settings, and when its context ended.
type Incarnation struct {
	Client    int           `json:"client"`
	Candidate int           `json:"candidate"`
	Mode      string        `json:"mode"`
	TTL       time.Duration `json:"ttl"`
	Margin    time.Duration `json:"margin"`
	Interval  time.Duration `json:"interval"`
	Start     int64         `json:"start"`
	// CtxEnd is when the process's context ended (a crash, a restart, or
	// the end of the run); math.MaxInt64 if it never did.
	CtxEnd  int64 `json:"ctx_end"`
	Crashed bool  `json:"crashed,omitempty"`
}

// TermRecord is one term as its leader's function saw it. Times are the
// recorder's local time; DB times are the database clock's Unix ns.
type TermRecord struct {
	Client int    `json:"client"` // the incarnation
	Mode   string `json:"mode"`
	Token  int64  `json:"token"`
	Leader string `json:"leader"`
	Guard  int    `json:"guard"` // its guard in the lock history
	// Start is when the function started; End when it saw its context
	// end, or when it chose to stop leading (Voluntary); Return when it
	// returned (after its cleanup).
	Start   int64 `json:"start"`
	End     int64 `json:"end"`
	Return  int64 `json:"return"`
	DBStart int64 `json:"db_start"`
	DBEnd   int64 `json:"db_end"`
	// Voluntary: the function returned before its context ended.
	Voluntary bool `json:"voluntary,omitempty"`
	// Lost: its context ended while the process's context was live.
	Lost  bool   `json:"lost,omitempty"`
	Cause string `json:"cause,omitempty"`
	// Writes counts the fenced writes the leader made.
	Writes int `json:"writes"`
}

// ReturnRecord is one return of Election.Run or Election.Campaign.
type ReturnRecord struct {
	Client int    `json:"client"`
	API    string `json:"api"` // "run" or "campaign"
	At     int64  `json:"at"`
	Err    string `json:"err,omitempty"`
	// CtxDone: the context passed to the call had ended.
	CtxDone bool `json:"ctx_done"`
	// AfterVoluntary (Run only): the last call of the function returned
	// before its context ended, so Run may return (documented).
	AfterVoluntary bool `json:"after_voluntary,omitempty"`
}

// ObsRecord is one value an observer received from Election.Observe.
type ObsRecord struct {
	Observer int    `json:"observer"`
	At       int64  `json:"at"`
	Leading  bool   `json:"leading"`
	Token    int64  `json:"token"`
	Leader   string `json:"leader"`
}

// ElectHistory is one run's record: the lock history (calls, the audit
// log, each term as a guard, the leaders' fenced writes, the faults) and
// the election's own events.
type ElectHistory struct {
	Seed         uint64           `json:"seed"`
	Key          string           `json:"key"`
	Lock         *history.History `json:"lock"`
	Incarnations []Incarnation    `json:"incarnations"`
	Terms        []TermRecord     `json:"terms"`
	Returns      []ReturnRecord   `json:"returns"`
	Observations []ObsRecord      `json:"observations"`
	Observers    int              `json:"observers"`
}

// ElectResult is one run's record and figures.
type ElectResult struct {
	History *ElectHistory
	Active  []faultbackend.Kind
	Counts  map[faultbackend.Kind]int64
	Fake    time.Duration
}

type candidate struct {
	idx                   int
	mode                  string
	ttl, margin, interval time.Duration
	restart               chan time.Duration // the driver's restart orders (a delay)

	mu  sync.Mutex // guards cur
	cur *incarnation
}

type incarnation struct {
	cand   *candidate
	rec    int // index in the world's incarnations
	id     int
	fb     *faultbackend.Backend
	c      *sqllock.Client
	e      *election.Election
	ctx    context.Context
	cancel context.CancelFunc
	rng    *rand.Rand // used by the incarnation's goroutine only

	lastVoluntary bool // Run mode: the function's last call returned voluntarily
}

type elWorld struct {
	cfg      ElectConfig
	rng      *rand.Rand
	rec      *history.Recorder
	clock    *faultbackend.Clock
	db       *faultbackend.DB
	res      *history.Resource
	key      string
	cands    []*candidate
	active   map[faultbackend.Kind]bool
	prob     map[faultbackend.Kind]float64
	maxDelay time.Duration
	minTTL   time.Duration
	maxOff   time.Duration
	ids      [][]int // ids[candidate][n-1]: the client ID of incarnation n
	obsIDs   []int
	up       []bool   // driver-owned: the candidate has a live process
	paused   []bool   // driver-owned
	upCh     chan int // a candidate reports its new process
	unpaused chan int

	ctx      context.Context // the run; cancelled by windDown
	cancel   context.CancelFunc
	stopping atomic.Bool // set by windDown: no process starts any more
	wg       sync.WaitGroup

	mu        sync.Mutex // guards the fields below
	incs      []Incarnation
	terms     []TermRecord
	returns   []ReturnRecord
	obs       []ObsRecord
	simCounts map[faultbackend.Kind]int64
}

// RunElection runs one seed of the election simulation. Call it inside a
// synctest bubble.
func RunElection(cfg ElectConfig) *ElectResult {
	if cfg.Steps == 0 {
		cfg.Steps = 150
	}
	start := time.Now()
	w := &elWorld{
		cfg:       cfg,
		rng:       rand.New(rand.NewPCG(cfg.Seed, 0xe1ec7)),
		active:    map[faultbackend.Kind]bool{},
		prob:      map[faultbackend.Kind]float64{},
		simCounts: map[faultbackend.Kind]int64{},
	}
	w.ctx, w.cancel = context.WithCancel(context.Background())
	nCands, nObs := 3+w.rng.IntN(3), 1+w.rng.IntN(2)
	for _, k := range ElectKinds {
		w.active[k] = w.rng.IntN(2) == 0
	}
	for _, k := range []faultbackend.Kind{faultbackend.FailBefore, faultbackend.FailAfter, faultbackend.Delay} {
		if w.active[k] {
			w.prob[k] = 0.05
		}
	}
	if w.active[faultbackend.Hang] {
		w.prob[faultbackend.Hang] = 0.02
	}
	w.rec = history.NewRecorder("election", cfg.Seed, history.Params{TokenStep1: true, NoLiveness: true})
	w.clock = faultbackend.NewClock(time.Now)
	w.db = faultbackend.NewDB(memory.NewWithClock(w.clock.Now), faultbackend.DBOptions{Clock: w.clock, Recorder: w.rec, Audit: true})
	w.res = history.NewResource(w.rec)
	w.key = election.KeyPrefix + ElectionName
	w.minTTL = time.Hour
	for i := range nCands {
		ttl := 2*time.Second + time.Duration(w.rng.Int64N(int64(3*time.Second)))
		mode := ModeRun
		if i > 0 && w.rng.IntN(3) == 0 {
			mode = ModeCampaign // candidate 0 always uses Run
		}
		w.cands = append(w.cands, &candidate{
			idx: i, mode: mode, ttl: ttl, margin: ttl / 5,
			interval: ttl/3 + time.Duration(w.rng.Int64N(int64(50*time.Millisecond))),
			restart:  make(chan time.Duration, 1),
		})
		w.minTTL = min(w.minTTL, ttl)
	}
	w.maxDelay = w.minTTL / 2
	w.maxOff = w.minTTL / 5 / 5 // 0.2 × the smallest margin: within A2
	w.assignIDs(nObs)
	w.up = make([]bool, nCands)
	w.paused = make([]bool, nCands)
	w.upCh = make(chan int, nCands)
	w.unpaused = make(chan int, nCands)
	polls := make([]time.Duration, nObs)
	for i := range polls {
		polls[i] = w.jitter(150*time.Millisecond, 400*time.Millisecond)
	}
	// Nobody starts at the same instant as another: who acts first would
	// be up to the scheduler.
	for _, cd := range w.cands {
		w.wg.Add(1)
		go w.candidateLoop(cd, w.jitter(time.Millisecond, 50*time.Millisecond))
	}
	for i := range nObs {
		w.wg.Add(1)
		go w.observer(i, polls[i], w.jitter(time.Millisecond, 50*time.Millisecond))
	}
	w.drive()
	w.windDown()

	h := &ElectHistory{Seed: cfg.Seed, Key: w.key, Lock: w.rec.History(), Observers: nObs}
	w.mu.Lock()
	h.Incarnations = append(h.Incarnations, w.incs...)
	h.Terms = append(h.Terms, w.terms...)
	h.Returns = append(h.Returns, w.returns...)
	h.Observations = append(h.Observations, w.obs...)
	res := &ElectResult{History: h, Counts: w.db.Counts(), Fake: time.Since(start)}
	for k, v := range w.simCounts {
		res.Counts[k] += v
	}
	w.mu.Unlock()
	for _, k := range ElectKinds {
		if w.active[k] {
			res.Active = append(res.Active, k)
		}
	}
	return res
}

// maxIncarnations is how many incarnations per candidate get a client ID
// of their own spread (more were never seen: a few restarts and crashes
// per candidate and seed).
const maxIncarnations = 64

// assignIDs chooses every client ID of the run before it starts, so that
// no two clients share a spread delay (two waiters would wake at the same
// instant after a release, and which one won would be up to the
// scheduler): candidate i's n-th process is i*1000+n, or that plus a
// multiple of 1e6 when its delay is taken.
func (w *elWorld) assignIDs(nObs int) {
	used := map[time.Duration]bool{}
	pick := func(base int) int {
		for id := base; ; id += 1_000_000 {
			if d := faultbackend.SpreadDelay(w.cfg.Seed, id, spread); !used[d] {
				used[d] = true
				return id
			}
		}
	}
	for i := range nObs {
		w.obsIDs = append(w.obsIDs, pick(100000+i))
	}
	w.ids = make([][]int, len(w.cands))
	for n := 1; n <= maxIncarnations; n++ {
		for i := range w.cands {
			w.ids[i] = append(w.ids[i], pick(i*1000+n))
		}
	}
}

func (w *elWorld) jitter(lo, span time.Duration) time.Duration {
	if span <= 0 {
		return lo
	}
	return lo + time.Duration(w.rng.Int64N(int64(span)))
}

func rngJitter(r *rand.Rand, lo, span time.Duration) time.Duration {
	if span <= 0 {
		return lo
	}
	return lo + time.Duration(r.Int64N(int64(span)))
}

func (w *elWorld) count(k faultbackend.Kind) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.simCounts[k]++
}

// incarnate starts a new process of cd: a new wrapper, client, election
// and context. The client IDs are chosen before the run (assignIDs), so
// that they do not depend on which of two candidates restarting at one
// instant came first.
func (w *elWorld) incarnate(cd *candidate, n int) *incarnation {
	id := cd.idx*1000 + n // beyond maxIncarnations: its delay may be shared
	if n <= maxIncarnations {
		id = w.ids[cd.idx][n-1]
	}
	fb := w.db.Client(faultbackend.Config{Client: id, Seed: w.cfg.Seed, Prob: w.prob, MaxDelay: w.maxDelay, Spread: spread})
	c, err := sqllock.New(fb, sqllock.Options{
		Owner:          fmt.Sprintf("c%d.%d", cd.idx, n),
		TTL:            cd.ttl,
		RenewInterval:  cd.interval,
		Margin:         cd.margin,
		Backoff:        Backoff,
		ReleaseTimeout: ElectReleaseTimeout,
	})
	if err != nil {
		panic(err)
	}
	e, err := election.New(c, election.Config{
		Name:    ElectionName,
		Backoff: func(a int) time.Duration { return ElectBackoff(a) + time.Duration(cd.idx)*37*time.Nanosecond },
		Value:   fmt.Appendf(nil, "addr-%d", cd.idx),
	})
	if err != nil {
		panic(err)
	}
	inc := &incarnation{cand: cd, id: id, fb: fb, c: c, e: e,
		rng: rand.New(rand.NewPCG(w.cfg.Seed, uint64(id)+1))}
	inc.ctx, inc.cancel = context.WithCancel(w.ctx)
	w.mu.Lock()
	inc.rec = len(w.incs)
	w.incs = append(w.incs, Incarnation{Client: id, Candidate: cd.idx, Mode: cd.mode, TTL: cd.ttl, Margin: cd.margin,
		Interval: cd.interval, Start: w.rec.Now(), CtxEnd: math.MaxInt64})
	w.mu.Unlock()
	cd.mu.Lock()
	cd.cur = inc
	cd.mu.Unlock()
	return inc
}

// candidateLoop runs cd's processes one after the other: each until its
// context ends, then the next after the driver's restart delay.
func (w *elWorld) candidateLoop(cd *candidate, delay time.Duration) {
	defer w.wg.Done()
	time.Sleep(delay)
	for n := 1; ; n++ {
		inc := w.incarnate(cd, n)
		w.upCh <- cd.idx
		ended := make(chan struct{})
		stop := context.AfterFunc(inc.ctx, func() {
			now := w.rec.Now()
			w.mu.Lock()
			w.incs[inc.rec].CtxEnd = now
			w.mu.Unlock()
			close(ended)
		})
		switch cd.mode {
		case ModeRun:
			w.runMode(inc)
		case ModeCampaign:
			w.campaignMode(inc)
		}
		<-ended
		stop()
		_ = inc.c.Close(context.Background())
		d, ok := <-cd.restart
		if !ok {
			return
		}
		time.Sleep(d)
		if w.stopping.Load() {
			return
		}
	}
}

// runMode is a process that calls Election.Run, and calls it again when
// its function returned of its own accord (a singleton job that finished
// and is started again). Any other return while its context is live
// breaks Run's contract: the process records it and stops campaigning, as
// a program whose main returned would.
func (w *elWorld) runMode(inc *incarnation) {
	for inc.ctx.Err() == nil {
		inc.lastVoluntary = false
		err := inc.e.Run(inc.ctx, func(ctx context.Context, t election.Term) error {
			w.lead(inc, ctx, nil, t)
			return nil
		})
		w.recordReturn(inc, "run", err, inc.ctx.Err() != nil, inc.lastVoluntary)
		if inc.ctx.Err() != nil {
			return
		}
		if !inc.lastVoluntary {
			<-inc.ctx.Done()
			return
		}
		if sleepCtx(inc.ctx, rngJitter(inc.rng, time.Millisecond, inc.cand.ttl/4)) != nil {
			return
		}
	}
}

// campaignMode is a process that calls Campaign (sometimes bounded by a
// timeout), leads under the Leadership's context (and its own), resigns,
// and campaigns again after a backoff.
func (w *elWorld) campaignMode(inc *incarnation) {
	for attempt := 1; inc.ctx.Err() == nil; {
		cctx, cancel := inc.ctx, context.CancelFunc(func() {})
		if inc.rng.IntN(4) == 0 {
			cctx, cancel = context.WithTimeout(inc.ctx, rngJitter(inc.rng, inc.cand.ttl/2, 2*inc.cand.ttl))
		}
		l, err := inc.e.Campaign(cctx)
		ctxDone := cctx.Err() != nil
		cancel()
		w.recordReturn(inc, "campaign", err, ctxDone, false)
		if err != nil {
			if inc.ctx.Err() != nil {
				return
			}
			if !ctxDone {
				// Campaign gave up although its context is live (an
				// anomaly, recorded above): a program would retry.
				attempt++
			}
			if sleepCtx(inc.ctx, ElectBackoff(attempt)) != nil {
				return
			}
			continue
		}
		lost := w.lead(inc, l.Context(), inc.ctx.Done(), l.Term())
		_ = l.Resign(context.WithoutCancel(inc.ctx))
		if lost {
			attempt++
		} else {
			attempt = 1
		}
		if sleepCtx(inc.ctx, ElectBackoff(attempt)) != nil {
			return
		}
	}
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

func (w *elWorld) recordReturn(inc *incarnation, api string, err error, ctxDone, voluntary bool) {
	r := ReturnRecord{Client: inc.id, API: api, At: w.rec.Now(), CtxDone: ctxDone, AfterVoluntary: voluntary}
	if err != nil {
		r.Err = err.Error()
	}
	w.mu.Lock()
	w.returns = append(w.returns, r)
	w.mu.Unlock()
}

// lead is the leader's function: fenced read-modify-writes with the term's
// token until ctx ends (or also, in Campaign mode, the process's context:
// stop), or until it chooses to stop; then a cleanup, then it returns.
// It records the term and reports whether the term was lost.
func (w *elWorld) lead(inc *incarnation, ctx context.Context, stop <-chan struct{}, t election.Term) (lost bool) {
	cd := inc.cand
	tr := TermRecord{Client: inc.id, Mode: cd.mode, Token: t.Token, Leader: t.Leader, Start: w.rec.Now(), DBStart: w.clock.Now().UnixNano()}
	tr.Guard = w.rec.GuardStart(history.Guard{Client: inc.id, Key: w.key, Owner: t.Leader, Token: t.Token,
		TTL: cd.ttl, Margin: cd.margin, Interval: cd.interval, Start: tr.Start})
	hold := time.Duration(math.MaxInt64)
	if inc.rng.IntN(3) == 0 {
		hold = rngJitter(inc.rng, 10*time.Millisecond, 2*cd.ttl)
	}
	holdT := time.NewTimer(hold)
	defer holdT.Stop()
	writeT := time.NewTimer(rngJitter(inc.rng, time.Millisecond, cd.ttl/5))
	defer writeT.Stop()
	acc := func() history.Access {
		return history.Access{Client: inc.id, Guard: tr.Guard, GuardValid: ctx.Err() == nil}
	}
	stopped := false
loop:
	for {
		select {
		case <-ctx.Done():
			break loop
		case <-stop:
			stopped = true
			break loop
		case <-holdT.C:
			tr.Voluntary = true
			break loop
		case <-writeT.C:
			if ctx.Err() == nil {
				if v, ok := w.res.Read(w.key, t.Token, acc()); ok {
					w.res.Write(w.key, t.Token, v+1, acc())
					tr.Writes++
				}
			}
			writeT.Reset(rngJitter(inc.rng, time.Millisecond, cd.ttl/5))
		}
	}
	tr.End, tr.DBEnd = w.rec.Now(), w.clock.Now().UnixNano()
	switch {
	case tr.Voluntary:
		tr.Cause = "resigned"
	case stopped:
		tr.Cause = "process stopped"
	default:
		tr.Cause = causeOfCtx(ctx)
		tr.Lost = inc.ctx.Err() == nil
	}
	end, cause := tr.End, tr.Cause
	w.rec.GuardUpdate(tr.Guard, func(g *history.Guard) { g.End, g.Cause = end, cause })
	// Cleanup after the term: the lease must not be released under it.
	time.Sleep(rngJitter(inc.rng, 0, cd.ttl/10))
	tr.Return = w.rec.Now()
	inc.lastVoluntary = tr.Voluntary
	w.mu.Lock()
	w.terms = append(w.terms, tr)
	w.mu.Unlock()
	return tr.Lost
}

// causeOfCtx names why ctx ended: the loss reason, not the last transient
// error (see causeOf).
func causeOfCtx(ctx context.Context) string {
	cause := context.Cause(ctx)
	var le *sqllock.LostError
	if errors.As(cause, &le) {
		return "lost: " + le.Reason.String()
	}
	return cause.Error()
}

// observer follows the election with Observe until the run ends. Its
// backend serves some reads stale or fails them when StaleRead is active.
func (w *elWorld) observer(i int, poll, delay time.Duration) {
	defer w.wg.Done()
	time.Sleep(delay)
	id := w.obsIDs[i]
	fb := w.db.Client(faultbackend.Config{Client: id, Seed: w.cfg.Seed, Spread: spread})
	var b sqllock.Backend = fb
	if w.active[StaleRead] {
		b = &staleReads{Backend: fb, w: w, rng: rand.New(rand.NewPCG(w.cfg.Seed, uint64(id)))}
	}
	c, err := sqllock.New(b, sqllock.Options{Owner: fmt.Sprintf("o%d", i), Backoff: Backoff})
	if err != nil {
		panic(err)
	}
	defer func() { _ = c.Close(context.Background()) }()
	e, err := election.New(c, election.Config{Name: ElectionName, PollInterval: poll})
	if err != nil {
		panic(err)
	}
	for o := range e.Observe(w.ctx) {
		r := ObsRecord{Observer: i, At: w.rec.Now(), Leading: o.Leading, Token: o.Term.Token, Leader: o.Term.Leader}
		w.mu.Lock()
		w.obs = append(w.obs, r)
		w.mu.Unlock()
	}
}

// staleReads is an observer's backend whose List sometimes returns an
// older answer (a lagging replica) or fails. Only the observer's Observe
// goroutine calls List, so its RNG draws are deterministic.
type staleReads struct {
	*faultbackend.Backend
	w    *elWorld
	rng  *rand.Rand
	past [][]sqllock.LockInfo
}

func (s *staleReads) List(ctx context.Context, prefix string) ([]sqllock.LockInfo, error) {
	u := s.rng.Float64()
	switch {
	case u < 0.05:
		s.w.count(ReadError)
		return nil, fmt.Errorf("%w: injected read error", sqllock.ErrUnavailable)
	case u < 0.2 && len(s.past) > 0:
		s.w.count(StaleRead)
		return s.past[s.rng.IntN(len(s.past))], nil
	}
	infos, err := s.Backend.List(ctx, prefix)
	if err == nil {
		s.past = append(s.past, infos)
		if len(s.past) > 8 {
			s.past = s.past[1:]
		}
	}
	return infos, err
}

// drive is the driver loop: sleep a seeded while, let everything settle,
// inject one fault or none.
func (w *elWorld) drive() {
	for range w.cfg.Steps {
		time.Sleep(w.jitter(time.Millisecond, w.minTTL/2))
		synctest.Wait()
		w.drainEl()
		u := w.rng.Float64()
		i := w.rng.IntN(len(w.cands))
		cd := w.cands[i]
		switch {
		case w.active[faultbackend.ClockJump] && u < 0.04:
			off := w.clock.Offset()
			w.db.StepClock(w.jitter(-w.maxOff-off, 2*w.maxOff))
		case w.active[Crash] && u < 0.08 && w.up[i]:
			// The process dies: no request of it reaches the backend any
			// more, and its code stops (its context ends at once).
			inc := w.current(cd)
			inc.fb.Kill()
			w.rec.Event(history.Event{Kind: history.EvCrash, Client: inc.id, Key: w.key, TTL: cd.ttl, At: w.rec.Now()})
			w.count(Crash)
			w.mu.Lock()
			w.incs[inc.rec].Crashed = true
			w.mu.Unlock()
			inc.cancel()
			w.up[i] = false
			cd.restart <- w.jitter(10*time.Millisecond, 2*cd.ttl)
		case w.active[Restart] && u < 0.12 && w.up[i]:
			inc := w.current(cd)
			w.count(Restart)
			inc.cancel()
			w.up[i] = false
			cd.restart <- w.jitter(10*time.Millisecond, cd.ttl)
		case w.active[Pause] && u < 0.16 && w.up[i] && !w.paused[i]:
			// The process's requests stall (none reaches the backend)
			// for a while; its timers still run.
			inc := w.current(cd)
			d := w.jitter(cd.ttl/2, 2*cd.ttl)
			w.rec.Event(history.Event{Kind: history.EvPause, Client: inc.id, Key: w.key, At: w.rec.Now(), D: d})
			w.count(Pause)
			w.paused[i] = true
			inc.fb.Pause(true)
			w.wg.Add(1)
			go func() {
				defer w.wg.Done()
				time.Sleep(d)
				inc.fb.Pause(false)
				w.unpaused <- i
			}()
		}
		synctest.Wait()
	}
}

func (w *elWorld) current(cd *candidate) *incarnation {
	cd.mu.Lock()
	defer cd.mu.Unlock()
	return cd.cur
}

func (w *elWorld) drainEl() {
	for {
		select {
		case i := <-w.upCh:
			w.up[i] = true
		case i := <-w.unpaused:
			w.paused[i] = false
		default:
			return
		}
	}
}

// windDown ends every process and observer and waits for every goroutine
// of the run, so that the bubble ends empty (G8).
func (w *elWorld) windDown() {
	w.stopping.Store(true)
	for _, cd := range w.cands {
		close(cd.restart)
	}
	// One process after the other, at instants of their own: processes
	// ended at one instant would settle and release their campaigns at
	// that instant, in an order up to the scheduler.
	for _, cd := range w.cands {
		if inc := w.current(cd); inc != nil {
			inc.cancel()
		}
		time.Sleep(w.jitter(time.Millisecond, time.Millisecond))
		synctest.Wait()
	}
	w.cancel()
	done := make(chan struct{})
	go func() {
		w.wg.Wait()
		close(done)
	}()
	for {
		select {
		case <-done:
			w.db.Wait()
			w.res.Finish()
			return
		case <-w.upCh:
		case <-w.unpaused:
		}
	}
}
