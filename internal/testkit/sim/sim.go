// Package sim is the deterministic simulation of ashlock: clients, the
// memory backend and the fault wrapper inside one testing/synctest bubble,
// driven by one goroutine with a seeded RNG (TestSim, TestSimDeterminism,
// TestSimCheckerSensitivity, TestSimPause, TestSimDBClockStep). The
// election's simulation is in elect.go, the scheduled jobs' (SIM-8) in
// jobs.go.
//
// Determinism: the driver is the only source of decisions besides the
// per-client fault RNGs; it sleeps a seeded duration, calls synctest.Wait
// so that everything woken by that sleep has settled, then takes one
// action and waits again. Every seeded duration carries nanosecond jitter,
// so two timers almost never fire at the same fake instant; SIM-2 checks
// that the same seed gives the same history.
package sim

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"
	"testing/synctest"
	"time"

	"github.com/ashlock/ashlock/internal/testkit/faultbackend"
	"github.com/ashlock/ashlock/internal/testkit/history"
	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

// Sim-level fault kinds (the wrapper counts the per-call ones).
const (
	Crash  faultbackend.Kind = "crash"
	Pause  faultbackend.Kind = "pause"
	Expire faultbackend.Kind = "expire"
	// Partition cuts a client off the backend for a while (SIM-5).
	Partition faultbackend.Kind = "partition"
)

// AllKinds are the fault kinds a random seed may activate.
var AllKinds = []faultbackend.Kind{
	faultbackend.FailBefore, faultbackend.FailAfter, faultbackend.Delay, faultbackend.Hang,
	faultbackend.ClockJump, Crash, Pause, Expire,
}

// Scenario selects a workload.
type Scenario int

// The scenarios.
const (
	// Random is SIM-1: 2–5 clients, 1–3 keys, each fault kind active with
	// probability 1/2.
	Random Scenario = iota
	// Paused is SIM-4: 2 clients, 1 key; the holder pauses (process and
	// watchdog) for 1.5×TTL between its read and its write.
	Paused
	// ClockStep is SIM-5: 2 clients, 1 key; the database clock steps
	// forward by 2×margin while the holder holds.
	ClockStep
	// Many is SIM-6: 2–3 client processes, each holding several leases at
	// once from 2–4 concurrent sessions over 4–8 keys, so that its
	// renewals go out in batches (a renew window of half the interval);
	// the per-call faults (a batch as a whole: fail before, reply lost,
	// delay, hang), clock jumps, expiries, and busy elements of a batch
	// (each active with probability 1/2). No crash or pause: a process's
	// sessions share its client.
	Many
	// Stuck is SIM-7: Many's clients, sessions and batches, with one fault
	// only: a call that never returns until its caller gives up (a
	// half-open connection; at most three in a row: three such
	// connections in a pool), while the calls after them are answered. A
	// renewal that hangs must be abandoned and retried in time: no lease
	// may be lost.
	Stuck
)

// Poll bounds a waiter's sleep between attempts: the Backoff below is at
// most 640ms plus a few µs.
const Poll = 650 * time.Millisecond

// spread keeps clients from acting at the same fake instant; see
// faultbackend.Config.Spread.
const spread = 10 * time.Microsecond

// Backoff is the clients' deterministic, stateless backoff (no global
// rand): 10ms·2^(attempt-1) capped at 640ms, plus a per-attempt offset of
// a few µs so that retries do not line up with other timers.
func Backoff(attempt int) time.Duration {
	d := 10 * time.Millisecond << min(max(attempt-1, 0), 6)
	return d + time.Duration(attempt%97)*7919*time.Nanosecond
}

// Config is one run.
type Config struct {
	Seed     uint64
	Steps    int // driver steps; default 200
	Scenario Scenario
	// Mutant, if not empty, breaks the memory backend the way it names
	// (see BackendMutants), to show that the checkers catch it.
	Mutant string
	// Permits, when not zero, makes every key a semaphore with that many
	// permits: sessions take a permit (Client.AcquirePermit) and fence
	// their writes by the permit's key and token (see permit.go).
	Permits int
	// Reap, when set, makes every Expire fault reap the keys whose lease
	// ended (memory's Reap with no retention) right after it expires its
	// key, so that keys are deleted and granted again in the middle of
	// everything else (see reap.go).
	Reap bool
}

// Result is one run's record.
type Result struct {
	History *history.History
	// Active lists the fault kinds this seed activated.
	Active []faultbackend.Kind
	// Counts are the faults injected, by kind.
	Counts map[faultbackend.Kind]int64
	// Fake is how much fake time the run took.
	Fake time.Duration
}

type plan struct {
	key     string
	wait    time.Duration
	works   []time.Duration
	gaps    []time.Duration
	crash   bool
	pauseAt int // the write before which the holder pauses; -1: none
	pause   time.Duration
}

type client struct {
	idx                   int
	ttl, interval, margin time.Duration
	window                time.Duration // the renew window; 0: the default
	proc                  int           // the index of its process's first session
	cmds                  chan plan
	planned               string // the key of its current plan (driver only)

	// Owned by the client's goroutine.
	id     int
	inc    int
	fb     *faultbackend.Backend
	c      *sqllock.Client
	ctx    context.Context
	cancel context.CancelFunc
}

// grave is a crashed incarnation: its context, and the guard it held.
type grave struct {
	cancel context.CancelFunc
	g      *sqllock.Guard
}

type world struct {
	cfg      Config
	rng      *rand.Rand
	rec      *history.Recorder
	clock    *faultbackend.Clock
	mem      *memory.Backend
	db       *faultbackend.DB
	res      *history.Resource
	keys     []string
	clients  []*client
	busy     []bool
	done     chan int
	active   map[faultbackend.Kind]bool
	prob     map[faultbackend.Kind]float64
	maxDelay time.Duration
	minTTL   time.Duration
	maxOff   time.Duration // |database clock offset| stays below this
	// maxHangRun bounds the calls of a client in a row that hang (Stuck).
	maxHangRun int

	wg sync.WaitGroup // client goroutines and guard watchers

	mu        sync.Mutex // guards the fields below
	nextID    int
	graveyard []grave
	simCounts map[faultbackend.Kind]int64
}

// Run runs one seed. Call it inside a synctest bubble (synctest.Test).
func Run(cfg Config) *Result {
	if cfg.Steps == 0 {
		cfg.Steps = 200
	}
	start := time.Now()
	w := &world{
		cfg:       cfg,
		rng:       rand.New(rand.NewPCG(cfg.Seed, 0x5eed)),
		active:    map[faultbackend.Kind]bool{},
		prob:      map[faultbackend.Kind]float64{},
		simCounts: map[faultbackend.Kind]int64{},
	}
	nClients, nKeys, slots := 2, 1, 1
	switch cfg.Scenario {
	case Random:
		nClients, nKeys = 2+w.rng.IntN(4), 1+w.rng.IntN(3)
		for _, k := range AllKinds {
			w.active[k] = w.rng.IntN(2) == 0
		}
	case Many:
		nClients, nKeys, slots = 2+w.rng.IntN(2), 4+w.rng.IntN(5), 2+w.rng.IntN(3)
		for _, k := range append(AllKinds, faultbackend.Busy) {
			w.active[k] = k != Crash && k != Pause && w.rng.IntN(2) == 0
		}
	case Stuck:
		nClients, nKeys, slots = 2+w.rng.IntN(2), 4+w.rng.IntN(5), 2+w.rng.IntN(3)
		w.active[faultbackend.Hang] = true
	case Paused:
		w.active[Pause] = true
	case ClockStep:
		w.active[faultbackend.ClockJump] = true
		w.active[Partition] = true
	}
	for _, k := range []faultbackend.Kind{faultbackend.FailBefore, faultbackend.FailAfter, faultbackend.Delay} {
		if w.active[k] {
			w.prob[k] = 0.08
		}
	}
	if w.active[faultbackend.Hang] {
		w.prob[faultbackend.Hang] = 0.03
		if cfg.Scenario == Stuck {
			// One call in four hangs, up to three in a row: a pool with
			// three half-open connections, each discarded by the caller
			// that gave up on it.
			w.prob[faultbackend.Hang], w.maxHangRun = 0.25, 3
		}
	}
	if w.active[faultbackend.Busy] {
		w.prob[faultbackend.Busy] = 0.1
	}
	// A reaped key's next grant starts above the floor (the largest token
	// any reaped key had), so with reaps tokens strictly increase but may
	// skip.
	params := history.Params{Poll: Poll + 2*spread, TokenStep1: !cfg.Reap, ClockStepsBeyondMargin: cfg.Scenario == ClockStep}
	if cfg.Permits > 0 {
		params = permitParams(params, cfg, nKeys)
	}
	w.rec = history.NewRecorder(fmt.Sprintf("sim-%d", cfg.Scenario), cfg.Seed, params)
	w.clock = faultbackend.NewClock(time.Now)
	w.mem = memory.NewWithClock(w.clock.Now)
	var db sqllock.Backend = w.mem
	if cfg.Mutant != "" {
		db = newMutantDB(w.mem, cfg.Mutant)
	}
	w.db = faultbackend.NewDB(db, faultbackend.DBOptions{Clock: w.clock, Recorder: w.rec, Audit: true})
	w.res = history.NewResource(w.rec)
	for i := range nKeys {
		w.keys = append(w.keys, fmt.Sprintf("k%d", i))
	}
	w.minTTL = time.Hour
	for range nClients {
		ttl := 2*time.Second + time.Duration(w.rng.Int64N(int64(8*time.Second)))
		if cfg.Scenario != Random && cfg.Scenario != Many && cfg.Scenario != Stuck {
			ttl = 3*time.Second + time.Duration(w.rng.Int64N(int64(time.Second)))
		}
		interval := ttl/3 + time.Duration(w.rng.Int64N(int64(50*time.Millisecond)))
		for range slots {
			cl := &client{
				idx: len(w.clients), ttl: ttl, margin: ttl / 5, interval: interval,
				proc: len(w.clients) / slots * slots,
				cmds: make(chan plan, 1),
			}
			if slots > 1 {
				cl.window = interval / 2
			}
			w.minTTL = min(w.minTTL, ttl)
			w.clients = append(w.clients, cl)
		}
	}
	w.maxDelay = w.minTTL * 3 / 4
	w.maxOff = w.minTTL / 5 / 5 // 0.2 × the smallest margin: within A2
	w.busy = make([]bool, len(w.clients))
	w.done = make(chan int, len(w.clients))
	for i, cl := range w.clients {
		if i%slots == 0 {
			w.incarnate(cl)
		} else {
			// Another session of the same process: its client.
			p := w.clients[i-i%slots]
			cl.id, cl.inc, cl.fb, cl.c, cl.ctx, cl.cancel = p.id, p.inc, p.fb, p.c, p.ctx, p.cancel
		}
		w.wg.Add(1)
		go w.loop(cl)
	}

	switch cfg.Scenario {
	case Random, Many, Stuck:
		w.drive()
	case Paused, ClockStep:
		w.scripted()
	}
	w.windDown()

	res := &Result{History: w.rec.History(), Counts: w.db.Counts(), Fake: time.Since(start)}
	w.mu.Lock()
	for k, v := range w.simCounts {
		res.Counts[k] += v
	}
	w.mu.Unlock()
	for _, k := range append(AllKinds, Partition, faultbackend.Busy) {
		if w.active[k] {
			res.Active = append(res.Active, k)
		}
	}
	return res
}

func (w *world) jitter(lo, span time.Duration) time.Duration {
	if span <= 0 {
		return lo
	}
	return lo + time.Duration(w.rng.Int64N(int64(span)))
}

func (w *world) count(k faultbackend.Kind) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.simCounts[k]++
}

// incarnate (re)starts cl as a fresh process: a new wrapper, client and
// context. Called by the driver before the loop starts, then only by cl's
// goroutine.
func (w *world) incarnate(cl *client) {
	w.mu.Lock()
	cl.id = w.nextID
	w.nextID++
	w.mu.Unlock()
	cl.inc++
	cl.fb = w.db.Client(faultbackend.Config{
		Client: cl.id, Seed: w.cfg.Seed, Prob: w.prob, MaxDelay: w.maxDelay, Spread: spread,
		MaxHangRun: w.maxHangRun,
	})
	c, err := sqllock.New(cl.fb, sqllock.Options{
		Owner:          fmt.Sprintf("c%d.%d", cl.idx, cl.inc),
		TTL:            cl.ttl,
		RenewInterval:  cl.interval,
		RenewWindow:    cl.window,
		Margin:         cl.margin,
		Backoff:        Backoff,
		ReleaseTimeout: time.Second,
	})
	if err != nil {
		panic(err)
	}
	cl.c = c
	cl.ctx, cl.cancel = context.WithCancel(context.Background())
}

func (w *world) loop(cl *client) {
	defer w.wg.Done()
	for p := range cl.cmds {
		w.session(cl, p)
		w.done <- cl.idx
	}
	cl.cancel()
}

// session is one acquire → fenced read-modify-writes → release (or crash).
func (w *world) session(cl *client, p plan) {
	rec := w.rec
	start := rec.Now()
	g, err := w.acquire(cl, p)
	wt := history.Wait{Client: cl.id, Key: p.key, Start: start, End: rec.Now()}
	if err != nil {
		wt.Err = err.Error()
		rec.Wait(wt)
		return
	}
	wt.Token = g.Token()
	rec.Wait(wt)
	tok := g.Token()
	key := g.Key() // p.key, or the permit's key
	gid := rec.GuardStart(history.Guard{
		Client: cl.id, Key: key, Owner: g.Lease().Owner, Token: tok,
		TTL: cl.ttl, Margin: cl.margin, Interval: cl.interval, Start: rec.Now(),
	})
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		<-g.Done()
		end := rec.Now()
		cause := causeOf(g)
		ld := rec.Local(g.LocalDeadline())
		rec.GuardUpdate(gid, func(hg *history.Guard) { hg.End, hg.Cause, hg.LocalDeadline = end, cause, ld })
	}()
	tick := func() { time.Sleep(time.Duration(cl.idx+1) * 731 * time.Nanosecond) }
	acc := func(zombie bool) history.Access {
		return history.Access{Client: cl.id, Guard: gid, GuardValid: g.Err() == nil, Zombie: zombie}
	}
	for i := range p.works {
		tick()
		if g.Err() != nil {
			break
		}
		v, ok := w.res.Read(key, tok, acc(false))
		if !ok {
			break
		}
		if i == p.pauseAt {
			// The whole process stops: the watchdog cannot reach the
			// backend, and the holder writes without looking at its guard
			// afterwards (a zombie).
			rec.Event(history.Event{Kind: history.EvPause, Client: cl.id, Key: key, Token: tok, At: rec.Now(), D: p.pause})
			w.count(Pause)
			cl.fb.Pause(true)
			time.Sleep(p.pause)
			cl.fb.Pause(false)
			w.res.Write(key, tok, v+1, acc(true))
			now := rec.Now()
			rec.GuardUpdate(gid, func(hg *history.Guard) { hg.Zombie, hg.BeliefEnd = true, now })
			break
		}
		time.Sleep(p.works[i])
		tick()
		if g.Err() != nil {
			break
		}
		w.res.Write(key, tok, v+1, acc(false))
		time.Sleep(p.gaps[i])
	}
	tick()
	if p.crash {
		cl.fb.Kill()
		rec.Event(history.Event{Kind: history.EvCrash, Client: cl.id, Key: key, Token: tok, TTL: cl.ttl, At: rec.Now()})
		w.count(Crash)
		w.mu.Lock()
		w.graveyard = append(w.graveyard, grave{cl.cancel, g})
		w.mu.Unlock()
		w.incarnate(cl)
		return
	}
	_ = g.Release(context.Background())
}

// causeOf names why g ended: the loss reason, not the last transient
// error, which depends on whether the renewal's own deadline or the expiry
// timer fired first at the same fake instant.
func causeOf(g *sqllock.Guard) string {
	cause := context.Cause(g.Context())
	var le *sqllock.LostError
	if errors.As(cause, &le) {
		return "lost: " + le.Reason.String()
	}
	return fmt.Sprint(cause)
}

func (w *world) newPlan(cl *client) plan {
	p := plan{
		key:     w.keys[w.rng.IntN(len(w.keys))],
		wait:    w.jitter(cl.ttl/2, 3*cl.ttl),
		pauseAt: -1,
	}
	n := w.rng.IntN(4)
	for range n {
		p.works = append(p.works, w.jitter(time.Millisecond, cl.ttl/3))
		p.gaps = append(p.gaps, w.jitter(time.Millisecond, cl.ttl/4))
	}
	if w.active[Crash] && w.rng.IntN(10) == 0 {
		p.crash = true
	}
	if w.active[Pause] && n > 0 && w.rng.IntN(7) == 0 {
		p.pauseAt = w.rng.IntN(n)
		p.pause = w.jitter(cl.ttl*6/5, cl.ttl)
	}
	return p
}

func (w *world) drain() {
	for {
		select {
		case i := <-w.done:
			w.busy[i] = false
		default:
			return
		}
	}
}

// sibling reports whether another session of client i's process is busy
// with key. Two sessions of one process never wait for one key at once:
// they share the backend wrapper, so a release would wake both at the
// same fake instant and the order of their attempts would be the
// scheduler's, not the seed's.
func (w *world) sibling(i int, key string) bool {
	for j, cl := range w.clients {
		if j != i && cl.proc == w.clients[i].proc && w.busy[j] && cl.planned == key {
			return true
		}
	}
	return false
}

func (w *world) send(i int, p plan) {
	w.busy[i] = true
	w.clients[i].planned = p.key
	w.clients[i].cmds <- p
}

// drive is SIM-1's driver loop.
func (w *world) drive() {
	for range w.cfg.Steps {
		time.Sleep(w.jitter(time.Millisecond, w.minTTL/2))
		synctest.Wait()
		w.drain()
		u := w.rng.Float64()
		switch {
		case w.active[faultbackend.ClockJump] && u < 0.04:
			off := w.clock.Offset()
			d := w.jitter(-w.maxOff-off, 2*w.maxOff)
			w.db.StepClock(d)
		case w.active[Expire] && u < 0.06:
			key := w.expiring(w.keys[w.rng.IntN(len(w.keys))])
			w.db.Expire(key)
			w.count(Expire)
			if w.cfg.Reap {
				w.reap(key)
			}
		default:
			i := w.rng.IntN(len(w.clients))
			if !w.busy[i] {
				if p := w.newPlan(w.clients[i]); !w.sibling(i, p.key) {
					w.send(i, p)
				}
			}
		}
		synctest.Wait()
	}
}

// scripted runs SIM-4 and SIM-5: client 0 holds and writes, client 1
// waits for the key, repeatedly.
func (w *world) scripted() {
	a, b := w.clients[0], w.clients[1]
	for range 3 {
		pa := plan{key: w.keys[0], wait: a.ttl, pauseAt: -1}
		writes := 3
		if w.cfg.Scenario == ClockStep {
			writes = 8 // long enough to outlive the lease
		}
		for range writes {
			pa.works = append(pa.works, w.jitter(time.Millisecond, a.ttl/10))
			pa.gaps = append(pa.gaps, w.jitter(time.Millisecond, a.ttl/10))
		}
		if w.cfg.Scenario == Paused {
			pa.pauseAt = 1
			pa.pause = w.jitter(a.ttl*3/2, time.Millisecond)
		}
		w.send(0, pa)
		synctest.Wait()
		time.Sleep(w.jitter(time.Millisecond, time.Millisecond))
		pb := plan{key: w.keys[0], wait: 4 * a.ttl, pauseAt: -1}
		for range 2 {
			pb.works = append(pb.works, w.jitter(time.Millisecond, b.ttl/10))
			pb.gaps = append(pb.gaps, w.jitter(time.Millisecond, b.ttl/10))
		}
		w.send(1, pb)
		synctest.Wait()
		if w.cfg.Scenario == ClockStep {
			// A holds (B waits) and its renewals stop reaching the
			// database (a partition); the database clock steps forward
			// by twice A's margin, beyond assumption A2, so the lease
			// ends at the database before A's local deadline.
			time.Sleep(a.ttl / 20)
			a.fb.Pause(true)
			w.count(Partition)
			w.db.StepClock(2 * a.margin)
			synctest.Wait()
			time.Sleep(a.ttl + a.ttl/5)
			a.fb.Pause(false)
			synctest.Wait()
		}
		for w.busy[0] || w.busy[1] {
			time.Sleep(w.jitter(10*time.Millisecond, time.Millisecond))
			synctest.Wait()
			w.drain()
		}
	}
}

// windDown lets every session finish, stops the clients and waits for
// every goroutine of the run, so that the bubble ends empty (G8).
func (w *world) windDown() {
	for {
		synctest.Wait()
		w.drain()
		idle := true
		for _, b := range w.busy {
			idle = idle && !b
		}
		if idle {
			break
		}
		time.Sleep(w.jitter(100*time.Millisecond, time.Millisecond))
	}
	for _, cl := range w.clients {
		close(cl.cmds)
	}
	w.mu.Lock()
	graves := w.graveyard
	w.mu.Unlock()
	for _, gr := range graves {
		// The process is gone; end its guard's watchdog (whose release
		// cannot reach the backend) and wait for it. The end of its
		// context starts a release of its own, which may win the race to
		// the backend; then the first Release here waits for it until its
		// bound ends, at the very instant that release's does, and which of
		// the two returns first is up to the scheduler. The second waits
		// for that release to finish, so that its return is in the history
		// on every run of the seed.
		gr.cancel()
		_ = gr.g.Release(context.Background())
		_ = gr.g.Release(context.Background())
	}
	w.wg.Wait()
	w.db.Wait()
	w.res.Finish()
}

// OpCounts renders the ops by kind and outcome: "acquire{ok:3 held:2}".
func OpCounts(h *history.History, into map[string]map[history.Outcome]int) {
	for _, op := range h.Ops {
		k := string(op.Kind)
		if into[k] == nil {
			into[k] = map[history.Outcome]int{}
		}
		into[k][op.Outcome]++
	}
}

// FormatOps renders the output of OpCounts in a fixed order.
func FormatOps(m map[string]map[history.Outcome]int) string {
	var parts []string
	for _, k := range []string{"acquire", "renew", "release"} {
		var os []string
		total := 0
		for o, n := range m[k] {
			os = append(os, fmt.Sprintf("%s:%d", o, n))
			total += n
		}
		sort.Strings(os)
		parts = append(parts, fmt.Sprintf("%s=%d{%s}", k, total, strings.Join(os, " ")))
	}
	return strings.Join(parts, " ")
}
