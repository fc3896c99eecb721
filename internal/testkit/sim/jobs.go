package sim

// The scheduled-jobs simulation (SIM-8, issue 26): every host of a fleet
// fires one job for each period from its own timer ("cron"), each timer
// skewed from the others by up to a bound, and runs it the way the README
// recipe says: Client.Do with one attempt (no Wait) and a MinHold. It runs
// over the memory backend and the fault wrapper inside one
// testing/synctest bubble, as Run does (see sim.go for why that is
// deterministic). CheckJobs counts the runs of each period.

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"testing/synctest"
	"time"

	"github.com/ashlock/ashlock/internal/testkit/faultbackend"
	"github.com/ashlock/ashlock/internal/testkit/history"
	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

// JobKey is the scheduled job's key.
const JobKey = "job"

// JobsLatency bounds how long after its timer fired a host's run may
// start (its one Do call, from the call to the job's first instant): the
// acquire's request delays (at most 2×55 ms per attempt) and, after a lost
// reply, the settling repeats (five, with the Backoff between them). The
// min hold must cover it on top of the skew: a host whose timer fired
// within the skew of the first can still reach the database later by
// this much. TestSimScheduledJobs checks that no run starts later.
const JobsLatency = time.Second

// jobsMaxDelay bounds each half of a Delay fault in SIM-8 (see
// JobsLatency).
const jobsMaxDelay = 55 * time.Millisecond

// JobsHold chooses the MinHold of SIM-8's hosts.
type JobsHold int

// The choices of JobsHold.
const (
	// HoldDesign is what the recipe needs: the skew bound + JobsLatency
	// + twice the database clock's largest offset (a step forward
	// shortens a hold in real time) + 1 ms (a hold ends at its instant:
	// a request at grant + MinHold exactly is granted).
	HoldDesign JobsHold = iota
	// HoldNone is no MinHold: a job shorter than the skew runs again on a
	// late host (the checker's sensitivity).
	HoldNone
	// HoldSkewOnly is just above the skew (S + 1 ms), the margin left
	// out: a late host whose request is delayed, or whose refusal's reply
	// is lost and settled by a repeat, or whose request meets a database
	// clock stepped forward, runs the job again (the checker's
	// sensitivity to the margin).
	HoldSkewOnly
)

func (h JobsHold) String() string {
	switch h {
	case HoldDesign:
		return "design"
	case HoldNone:
		return "none"
	case HoldSkewOnly:
		return "skew-only"
	}
	return fmt.Sprintf("JobsHold(%d)", int(h))
}

// JobsKinds are the fault kinds a seed of SIM-8 may activate, each with
// probability 1/2: those that apply to a job run under a lease. Not
// Expire: an operator's forced release ends a min hold on purpose (the
// documented override), so the run after it is not a duplicate of the
// recipe's making.
var JobsKinds = []faultbackend.Kind{
	faultbackend.FailBefore, faultbackend.FailAfter, faultbackend.Delay, faultbackend.Hang,
	faultbackend.ClockJump, Crash, Pause,
}

// JobsConfig is one run of SIM-8.
type JobsConfig struct {
	Seed    uint64
	Periods int // default 6
	// Faults activates each of JobsKinds with probability 1/2; without
	// it no fault is injected, and every period must run exactly once.
	Faults bool
	Hold   JobsHold
}

// JobRun is one run of the job: which host's timer fired it, for which
// period, when the timer fired and when the job started (recorder time),
// and the grant it ran under.
type JobRun struct {
	Host   int   `json:"host"`
	Client int   `json:"client"`
	Period int   `json:"period"`
	Token  int64 `json:"token"`
	Fire   int64 `json:"fire"`
	Start  int64 `json:"start"`
	// DBGrant is the grant's database time (Unix ns).
	DBGrant int64 `json:"db_grant"`
}

// JobsResult is one run's record.
type JobsResult struct {
	History *history.History
	Runs    []JobRun
	Periods int
	Hosts   int
	Period  time.Duration
	Skew    time.Duration // the bound S: host 0 fires at P·k, host 1 at P·k + S
	MinHold time.Duration
	Active  []faultbackend.Kind
	Counts  map[faultbackend.Kind]int64
	Fake    time.Duration
}

type jobHost struct {
	idx                   int
	skew                  time.Duration
	ttl, interval, margin time.Duration
	rng                   *rand.Rand // the host loop's only
}

// firePlan is what a firing does, drawn by its host's loop.
type firePlan struct {
	period int
	job    time.Duration
	crash  bool
	pause  time.Duration // 0: none
}

type jobsWorld struct {
	cfg     JobsConfig
	rng     *rand.Rand
	rec     *history.Recorder
	clock   *faultbackend.Clock
	db      *faultbackend.DB
	res     *history.Resource
	period  time.Duration
	minHold time.Duration
	maxOff  time.Duration
	active  map[faultbackend.Kind]bool
	prob    map[faultbackend.Kind]float64
	hosts   []*jobHost

	wg sync.WaitGroup // host loops, firings, guard watchers

	mu        sync.Mutex // guards the fields below
	nextID    int
	runs      []JobRun
	simCounts map[faultbackend.Kind]int64
}

// RunJobs runs one seed of SIM-8. Call it inside a synctest bubble.
func RunJobs(cfg JobsConfig) *JobsResult {
	if cfg.Periods == 0 {
		cfg.Periods = 6
	}
	start := time.Now()
	w := &jobsWorld{
		cfg:       cfg,
		rng:       rand.New(rand.NewPCG(cfg.Seed, 0x10b5)),
		active:    map[faultbackend.Kind]bool{},
		prob:      map[faultbackend.Kind]float64{},
		simCounts: map[faultbackend.Kind]int64{},
	}
	if cfg.Faults {
		for _, k := range JobsKinds {
			w.active[k] = w.rng.IntN(2) == 0
		}
	}
	for _, k := range []faultbackend.Kind{faultbackend.FailBefore, faultbackend.FailAfter, faultbackend.Delay} {
		if w.active[k] {
			w.prob[k] = 0.08
		}
	}
	if w.active[faultbackend.Hang] {
		w.prob[faultbackend.Hang] = 0.03
	}
	w.period = jit(w.rng, 20*time.Second, 20*time.Second)
	skew := jit(w.rng, 500*time.Millisecond, 3*time.Second)
	nHosts := 2 + w.rng.IntN(4)
	minTTL := time.Hour
	for i := range nHosts {
		h := &jobHost{idx: i, rng: rand.New(rand.NewPCG(cfg.Seed, uint64(i)+1))}
		switch i {
		case 0:
			h.skew = 0
		case 1:
			h.skew = skew // the latest a timer may fire
		default:
			h.skew = jit(w.rng, 0, skew) + time.Duration(i)*time.Nanosecond
		}
		h.ttl = jit(w.rng, 2*time.Second, 6*time.Second)
		h.interval = h.ttl/3 + jit(w.rng, 0, 50*time.Millisecond)
		h.margin = h.ttl / 5
		minTTL = min(minTTL, h.ttl)
		w.hosts = append(w.hosts, h)
	}
	w.maxOff = minTTL / 5 / 5 // 0.2 × the smallest margin: within A2
	switch cfg.Hold {
	case HoldDesign:
		w.minHold = skew + JobsLatency + 2*w.maxOff + time.Millisecond
	case HoldSkewOnly:
		w.minHold = skew + time.Millisecond
	}
	params := history.Params{Poll: Poll + 2*spread, TokenStep1: true}
	w.rec = history.NewRecorder("sim-jobs-"+cfg.Hold.String(), cfg.Seed, params)
	w.clock = faultbackend.NewClock(time.Now)
	w.db = faultbackend.NewDB(memory.NewWithClock(w.clock.Now), faultbackend.DBOptions{Clock: w.clock, Recorder: w.rec, Audit: true})
	w.res = history.NewResource(w.rec)

	for _, h := range w.hosts {
		w.wg.Add(1)
		go w.host(h, start)
	}
	end := start.Add(time.Duration(cfg.Periods) * w.period)
	for time.Now().Before(end) {
		time.Sleep(w.jitter(100*time.Millisecond, w.period/4))
		synctest.Wait()
		if w.active[faultbackend.ClockJump] && w.rng.IntN(3) == 0 {
			off := w.clock.Offset()
			w.db.StepClock(w.jitter(-w.maxOff-off, 2*w.maxOff))
		}
		synctest.Wait()
	}
	w.wg.Wait()
	w.db.Wait()
	w.res.Finish()

	res := &JobsResult{
		History: w.rec.History(), Periods: cfg.Periods, Hosts: nHosts, Period: w.period, Skew: skew,
		MinHold: w.minHold, Counts: w.db.Counts(), Fake: time.Since(start),
	}
	w.mu.Lock()
	res.Runs = append(res.Runs, w.runs...)
	for k, v := range w.simCounts {
		res.Counts[k] += v
	}
	w.mu.Unlock()
	sort.Slice(res.Runs, func(i, j int) bool { return res.Runs[i].Start < res.Runs[j].Start })
	for _, k := range JobsKinds {
		if w.active[k] {
			res.Active = append(res.Active, k)
		}
	}
	return res
}

func jit(rng *rand.Rand, lo, span time.Duration) time.Duration {
	if span <= 0 {
		return lo
	}
	return lo + time.Duration(rng.Int64N(int64(span)))
}

func (w *jobsWorld) jitter(lo, span time.Duration) time.Duration { return jit(w.rng, lo, span) }

func (w *jobsWorld) count(k faultbackend.Kind) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.simCounts[k]++
}

// host is one host's timer: it fires the job for period k at P·k + skew,
// each firing a process of its own (as cron starts one), whether or not
// the one before it has ended.
func (w *jobsWorld) host(h *jobHost, start time.Time) {
	defer w.wg.Done()
	for k := range w.cfg.Periods {
		time.Sleep(time.Until(start.Add(time.Duration(k)*w.period + h.skew)))
		p := firePlan{period: k, job: jit(h.rng, 50*time.Millisecond, 2*w.hosts[1].skew)}
		if w.active[Crash] && h.rng.IntN(8) == 0 {
			p.crash = true
		}
		if w.active[Pause] && h.rng.IntN(8) == 0 {
			p.pause = jit(h.rng, h.ttl, h.ttl)
		}
		w.wg.Add(1)
		go w.fire(h, p)
	}
}

// fire is one firing: a fresh process (client) that runs the job with Do,
// one attempt, under the cron job's own timeout (three quarters of the
// period).
func (w *jobsWorld) fire(h *jobHost, p firePlan) {
	defer w.wg.Done()
	rec := w.rec
	w.mu.Lock()
	id := w.nextID
	w.nextID++
	w.mu.Unlock()
	fb := w.db.Client(faultbackend.Config{
		Client: id, Seed: w.cfg.Seed, Prob: w.prob, MaxDelay: jobsMaxDelay, Spread: spread,
	})
	c, err := sqllock.New(fb, sqllock.Options{
		Owner:          fmt.Sprintf("h%d.p%d", h.idx, p.period),
		TTL:            h.ttl,
		RenewInterval:  h.interval,
		Margin:         h.margin,
		Backoff:        Backoff,
		ReleaseTimeout: time.Second,
	})
	if err != nil {
		panic(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), w.period*3/4)
	defer cancel()
	fire := rec.Now()
	ran := false
	err = c.Do(ctx, JobKey, &sqllock.AcquireOptions{TTL: h.ttl, MinHold: w.minHold}, func(jctx context.Context, g *sqllock.Guard) error {
		ran = true
		w.job(h, p, id, fire, fb, jctx, g)
		return nil
	})
	if !ran {
		wt := history.Wait{Client: id, Key: JobKey, Start: fire, End: rec.Now()}
		if err != nil {
			wt.Err = err.Error()
		}
		rec.Wait(wt)
	}
	_ = c.Close(context.Background())
}

// job is the job itself: a fenced read-modify-write of the counter around
// the job's work, and the crash or pause the plan says.
func (w *jobsWorld) job(h *jobHost, p firePlan, id int, fire int64, fb *faultbackend.Backend, jctx context.Context, g *sqllock.Guard) {
	rec := w.rec
	tok := g.Token()
	startAt := rec.Now()
	rec.Wait(history.Wait{Client: id, Key: JobKey, Start: fire, End: startAt, Token: tok})
	w.mu.Lock()
	w.runs = append(w.runs, JobRun{Host: h.idx, Client: id, Period: p.period, Token: tok, Fire: fire, Start: startAt,
		DBGrant: g.Lease().BackendTime.UnixNano()})
	w.mu.Unlock()
	gid := rec.GuardStart(history.Guard{
		Client: id, Key: JobKey, Owner: g.Lease().Owner, Token: tok,
		TTL: h.ttl, Margin: h.margin, Interval: h.interval, Start: startAt,
	})
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		<-g.Done()
		end := rec.Now()
		cause := jobCause(g)
		ld := rec.Local(g.LocalDeadline())
		rec.GuardUpdate(gid, func(hg *history.Guard) { hg.End, hg.Cause, hg.LocalDeadline = end, cause, ld })
	}()
	acc := func(zombie bool) history.Access {
		return history.Access{Client: id, Guard: gid, GuardValid: g.Err() == nil, Zombie: zombie}
	}
	v, ok := w.res.Read(JobKey, tok, acc(false))
	if !ok {
		return
	}
	if p.pause > 0 {
		// The whole process stops in the middle of the job; it writes
		// without looking at its guard afterwards (a zombie).
		time.Sleep(p.job / 2)
		rec.Event(history.Event{Kind: history.EvPause, Client: id, Key: JobKey, Token: tok, At: rec.Now(), D: p.pause})
		w.count(Pause)
		fb.Pause(true)
		time.Sleep(p.pause)
		fb.Pause(false)
		w.res.Write(JobKey, tok, v+1, acc(true))
		now := rec.Now()
		rec.GuardUpdate(gid, func(hg *history.Guard) { hg.Zombie, hg.BeliefEnd = true, now })
		return
	}
	t := time.NewTimer(p.job)
	defer t.Stop()
	select {
	case <-t.C:
	case <-jctx.Done():
		return
	}
	if p.crash {
		// The process dies before it writes or releases: nothing more of
		// it reaches the database (Do's release is not sent).
		fb.Kill()
		rec.Event(history.Event{Kind: history.EvCrash, Client: id, Key: JobKey, Token: tok, TTL: h.ttl, At: rec.Now()})
		w.count(Crash)
		return
	}
	if g.Err() == nil {
		w.res.Write(JobKey, tok, v+1, acc(false))
	}
}

// jobCause names why g ended, as causeOf does.
func jobCause(g *sqllock.Guard) string {
	cause := context.Cause(g.Context())
	var le *sqllock.LostError
	if errors.As(cause, &le) {
		return "lost: " + le.Reason.String()
	}
	return fmt.Sprint(cause)
}

// JobsReport is what CheckJobs found.
type JobsReport struct {
	// PerPeriod counts the runs fired for each period.
	PerPeriod []int `json:"per_period"`
	// Duplicates is the runs beyond the first of a period, over all
	// periods: the recipe promises 0.
	Duplicates int `json:"duplicates"`
	// FirstDuplicate describes the first period that ran twice.
	FirstDuplicate string `json:"first_duplicate,omitempty"`
	// Empty is the periods that did not run at all (a fault may cause
	// one: at most once, not exactly once).
	Empty int `json:"empty"`
	// MaxLateness is the longest time from a run's timer to its start.
	MaxLateness time.Duration `json:"max_lateness"`
}

// CheckJobs counts the runs of each period (by the period whose timer
// fired them, whenever they started).
func CheckJobs(res *JobsResult) *JobsReport {
	r := &JobsReport{PerPeriod: make([]int, res.Periods)}
	byPeriod := make([][]JobRun, res.Periods)
	for _, run := range res.Runs {
		byPeriod[run.Period] = append(byPeriod[run.Period], run)
		r.MaxLateness = max(r.MaxLateness, time.Duration(run.Start-run.Fire))
	}
	for k, runs := range byPeriod {
		r.PerPeriod[k] = len(runs)
		switch {
		case len(runs) == 0:
			r.Empty++
		case len(runs) > 1:
			r.Duplicates += len(runs) - 1
			if r.FirstDuplicate == "" {
				a, b := runs[0], runs[1]
				r.FirstDuplicate = fmt.Sprintf("period %d ran %d times: host %d (timer +%v, token %d, db grant %v) and host %d (timer +%v, token %d, db grant +%v after the first; min hold %v)",
					k, len(runs), a.Host, time.Duration(a.Fire)-time.Duration(k)*res.Period, a.Token, time.Unix(0, a.DBGrant).UTC().Format("15:04:05.000000"),
					b.Host, time.Duration(b.Fire)-time.Duration(k)*res.Period, b.Token, time.Duration(b.DBGrant-a.DBGrant), res.MinHold)
			}
		}
	}
	return r
}
