package sim

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"sort"
	"sync"
	"time"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

// The key-set simulation (SIM-9): clients take sets of keys with
// Client.AcquireAll (one attempt, or waiting), work under the set, and
// release it, under crashes, pauses (the process cut off from the
// database for longer than a TTL), lost replies (applied, answered as
// unknown), failures before sending and delays. Two checkers: partial
// grants, counted at the database (every acquire of a set changes all
// of its keys or none), and two holders of one key at once (by the
// members' lifetimes: from AcquireAll's return to the end of the
// member's context, or its process's crash). Both must be 0.
//
// Each client's plans come from the seed, but unlike SIM-1 the clients
// act on goroutines of their own: goroutines woken at one fake instant
// may interleave differently from run to run, so a seed replays the
// same plans, not always the same history.

// The backend mutants of the key-set simulation (MultiConfig.Mutant).
const (
	// MutantPartialGrant takes a set key by key in key order and keeps
	// what it got when a key refuses: the trap the capability rules out.
	MutantPartialGrant = "partial-grant"
	// MutantGrantPastHolder grants a set over a key another owner holds.
	MutantGrantPastHolder = "grant-past-holder"
)

// MultiConfig is one run of the key-set simulation.
type MultiConfig struct {
	Seed     uint64
	Sessions int    // per client; default 25
	Mutant   string // "" or one of the Mutant constants above
}

// MultiResult is one run's record.
type MultiResult struct {
	Grants, Refusals, Failures int // AcquireAll outcomes
	Partial                    int // acquires of a set that changed some of its keys, not all
	Overlaps                   int // two holders of one key at once
	Faults                     map[string]int
	Examples                   []string // the first anomalies, for the failure message
}

// fault kinds of the key-set simulation.
const (
	mfFailBefore = "fail-before"
	mfReplyLost  = "reply-lost"
	mfDelay      = "delay"
	mfCrash      = "crash"
	mfPause      = "pause"
)

// MultiFaultKinds are the faults every run may inject.
var MultiFaultKinds = []string{mfFailBefore, mfReplyLost, mfDelay, mfCrash, mfPause}

// multiDB is the database of the run: the memory backend behind one
// mutex, so that the partial-grant audit around each acquire of a set
// sees nothing else happen; with a mutant, broken.
type multiDB struct {
	mem    *memory.Backend
	mutant string

	mu      sync.Mutex // serialises every call
	partial int
	example string
}

func (d *multiDB) TryAcquire(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.mem.TryAcquire(ctx, req)
}

func (d *multiDB) TryRenew(ctx context.Context, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.mem.TryRenew(ctx, l, ttl)
}

func (d *multiDB) TryRenewBatch(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.mem.TryRenewBatch(ctx, reqs)
}

func (d *multiDB) Release(ctx context.Context, l sqllock.Lease) error {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.mem.Release(ctx, l)
}

func (d *multiDB) ReleaseAll(ctx context.Context, ls []sqllock.Lease) ([]error, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.mem.ReleaseAll(ctx, ls)
}

func (d *multiDB) List(ctx context.Context, prefix string) ([]sqllock.LockInfo, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.mem.List(ctx, prefix)
}

func (d *multiDB) Watch(key string) (<-chan struct{}, func()) { return d.mem.Watch(key) }

// TryAcquireAll applies the set and audits it: the keys it changed, by
// the rows before and after.
func (d *multiDB) TryAcquireAll(ctx context.Context, req sqllock.MultiAcquireRequest) ([]sqllock.Lease, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	before := d.rows(req.Keys)
	ls, err := d.apply(ctx, req)
	after := d.rows(req.Keys)
	changed := 0
	for _, k := range req.Keys {
		if before[k] != after[k] {
			changed++
		}
	}
	if changed != 0 && changed != len(req.Keys) {
		d.partial++
		if d.example == "" {
			d.example = fmt.Sprintf("partial grant: %d of %q changed by %s (%v)", changed, req.Keys, req.Owner, err)
		}
	}
	return ls, err
}

func (d *multiDB) apply(ctx context.Context, req sqllock.MultiAcquireRequest) ([]sqllock.Lease, error) {
	switch d.mutant {
	case MutantPartialGrant:
		var ls []sqllock.Lease
		for _, k := range sqllock.SortedKeys(req.Keys) {
			l, err := d.mem.TryAcquire(ctx, sqllock.AcquireRequest{Key: k, TTL: req.TTL, Owner: req.Owner, Value: req.Value})
			if err != nil {
				return nil, err // what was granted stays granted
			}
			ls = append(ls, l)
		}
		out := make([]sqllock.Lease, len(req.Keys))
		for i, k := range req.Keys {
			out[i] = ls[slices.IndexFunc(ls, func(l sqllock.Lease) bool { return l.Key == k })]
		}
		return out, nil
	case MutantGrantPastHolder:
		ls, err := d.mem.TryAcquireAll(ctx, req)
		var he *sqllock.HeldError
		if errors.As(err, &he) && he.Owner != "" {
			// Take the held key over as if it had expired.
			d.mem.Expire(he.Key)
			return d.mem.TryAcquireAll(ctx, req)
		}
		return ls, err
	}
	return d.mem.TryAcquireAll(ctx, req)
}

// row is what the audit compares of a key.
type row struct {
	token    int64
	owner    string
	held     bool
	deadline time.Time
}

func (d *multiDB) rows(keys []string) map[string]row {
	out := make(map[string]row, len(keys))
	for _, k := range keys {
		infos, _ := d.mem.List(context.Background(), k)
		for _, i := range infos {
			if i.Key == k {
				out[k] = row{i.Token, i.Owner, i.Held, i.Deadline}
			}
		}
	}
	return out
}

// multiNet is one process's connection to the database: it injects the
// run's faults, and is cut off (killed) when the process crashes.
type multiNet struct {
	db *multiDB
	w  *multiWorld

	mu          sync.Mutex // guards the fields below
	rng         *rand.Rand
	killed      bool
	pausedUntil time.Time
}

// call runs apply through the faults: not sent, delayed, applied with
// its reply lost (then lostErr), or applied and answered.
func (n *multiNet) call(ctx context.Context, lostErr error, apply func() error) error {
	n.mu.Lock()
	killed, until := n.killed, n.pausedUntil
	u, delay := n.rng.Float64(), time.Duration(n.rng.Int64N(int64(300*time.Millisecond)))
	n.mu.Unlock()
	if killed {
		return fmt.Errorf("%w: sim: the process is gone", sqllock.ErrUnavailable)
	}
	if d := time.Until(until); d > 0 {
		if sleepCtx(ctx, d) != nil {
			return errors.Join(sqllock.ErrUnavailable, ctx.Err()) // never sent
		}
	}
	switch {
	case u < 0.05:
		n.w.count(mfFailBefore)
		return fmt.Errorf("%w: sim: failed before sending", sqllock.ErrUnavailable)
	case u < 0.10:
		n.w.count(mfDelay)
		if sleepCtx(ctx, delay) != nil {
			return errors.Join(sqllock.ErrUnavailable, ctx.Err())
		}
	case u < 0.15:
		n.w.count(mfReplyLost)
		if err := apply(); err != nil {
			return err
		}
		return lostErr
	}
	return apply()
}

func (n *multiNet) TryAcquire(ctx context.Context, req sqllock.AcquireRequest) (l sqllock.Lease, err error) {
	err = n.call(ctx, sqllock.ErrIndeterminate, func() (e error) { l, e = n.db.TryAcquire(ctx, req); return e })
	return l, err
}

func (n *multiNet) TryAcquireAll(ctx context.Context, req sqllock.MultiAcquireRequest) (ls []sqllock.Lease, err error) {
	err = n.call(ctx, sqllock.ErrIndeterminate, func() (e error) { ls, e = n.db.TryAcquireAll(ctx, req); return e })
	if err != nil {
		ls = nil
	}
	return ls, err
}

func (n *multiNet) TryRenew(ctx context.Context, l sqllock.Lease, ttl time.Duration) (r sqllock.Lease, err error) {
	err = n.call(ctx, sqllock.ErrUnavailable, func() (e error) { r, e = n.db.TryRenew(ctx, l, ttl); return e })
	return r, err
}

func (n *multiNet) TryRenewBatch(ctx context.Context, reqs []sqllock.RenewRequest) (res []sqllock.RenewResult, err error) {
	err = n.call(ctx, sqllock.ErrUnavailable, func() (e error) { res, e = n.db.TryRenewBatch(ctx, reqs); return e })
	if err != nil {
		res = nil
	}
	return res, err
}

func (n *multiNet) Release(ctx context.Context, l sqllock.Lease) error {
	return n.call(ctx, sqllock.ErrIndeterminate, func() error { return n.db.Release(ctx, l) })
}

// ReleaseAll releases a set in one call, through the faults as any call.
func (n *multiNet) ReleaseAll(ctx context.Context, ls []sqllock.Lease) (answers []error, err error) {
	err = n.call(ctx, sqllock.ErrIndeterminate, func() (e error) { answers, e = n.db.ReleaseAll(ctx, ls); return e })
	if err != nil {
		answers = nil
	}
	return answers, err
}

func (n *multiNet) List(ctx context.Context, prefix string) ([]sqllock.LockInfo, error) {
	return n.db.List(ctx, prefix)
}

func (n *multiNet) Watch(key string) (<-chan struct{}, func()) { return n.db.Watch(key) }

// hold is one member's tenure as its holder believes it.
type hold struct {
	key        string
	owner      string
	token      int64
	start, end time.Time // end zero: not ended yet
}

type multiWorld struct {
	cfg  MultiConfig
	db   *multiDB
	keys []string
	wg   sync.WaitGroup

	mu     sync.Mutex // guards the fields below
	holds  []*hold
	faults map[string]int
	res    MultiResult
}

func (w *multiWorld) count(kind string) {
	w.mu.Lock()
	w.faults[kind]++
	w.mu.Unlock()
}

// RunMulti runs one seed of the key-set simulation. Call it inside a
// synctest bubble.
func RunMulti(cfg MultiConfig) *MultiResult {
	if cfg.Sessions == 0 {
		cfg.Sessions = 25
	}
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x5e7))
	w := &multiWorld{cfg: cfg, db: &multiDB{mem: memory.New(), mutant: cfg.Mutant}, faults: map[string]int{}}
	for i := range 4 + rng.IntN(3) {
		w.keys = append(w.keys, fmt.Sprintf("k%d", i))
	}
	clients := 3 + rng.IntN(3)
	for c := range clients {
		seed := rng.Uint64()
		w.wg.Go(func() { w.process(c, seed) })
	}
	w.wg.Wait()
	w.check()
	res := w.res
	res.Faults = w.faults
	res.Partial = w.db.partial
	if w.db.example != "" {
		res.Examples = append([]string{w.db.example}, res.Examples...)
	}
	return &res
}

// process is one client's life: sessions, with crashes restarting it as a
// new process (a new Client on a new connection).
func (w *multiWorld) process(idx int, seed uint64) {
	rng := rand.New(rand.NewPCG(seed, uint64(idx)))
	ttl := 2*time.Second + time.Duration(rng.Int64N(int64(3*time.Second)))
	inc := 0
	var net *multiNet
	var c *sqllock.Client
	start := func() {
		inc++
		net = &multiNet{db: w.db, w: w, rng: rand.New(rand.NewPCG(rng.Uint64(), 1))}
		var err error
		c, err = sqllock.New(net, sqllock.Options{
			Owner: fmt.Sprintf("c%d.%d", idx, inc), TTL: ttl, Margin: ttl / 5,
			Backoff: Backoff, ReleaseTimeout: time.Second,
		})
		if err != nil {
			panic(err)
		}
	}
	start()
	for range w.cfg.Sessions {
		time.Sleep(time.Duration(rng.Int64N(int64(ttl))))
		keys := slices.Clone(w.keys)
		rng.Shuffle(len(keys), func(i, j int) { keys[i], keys[j] = keys[j], keys[i] })
		keys = keys[:1+rng.IntN(min(4, len(keys)))]
		var wait time.Duration
		if rng.IntN(3) > 0 {
			wait = time.Duration(rng.Int64N(int64(3 * ttl)))
		}
		set, err := c.AcquireAll(context.Background(), keys, &sqllock.AcquireOptions{Wait: wait})
		if err != nil {
			w.mu.Lock()
			if errors.Is(err, sqllock.ErrNotAcquired) {
				w.res.Refusals++
			} else {
				w.res.Failures++
			}
			w.mu.Unlock()
			continue
		}
		hs := w.begin(set)
		switch u := rng.IntN(10); {
		case u == 0: // a crash mid-work: the process and its beliefs end
			time.Sleep(time.Duration(rng.Int64N(int64(ttl))))
			w.count(mfCrash)
			net.mu.Lock()
			net.killed = true
			net.mu.Unlock()
			w.endAll(hs)
			old := c
			w.wg.Go(func() { _ = old.Close(context.Background()) })
			start()
			continue
		case u == 1: // cut off from the database for longer than the TTL
			w.count(mfPause)
			net.mu.Lock()
			net.pausedUntil = time.Now().Add(ttl + time.Duration(rng.Int64N(int64(ttl))))
			net.mu.Unlock()
		}
		work := time.Duration(rng.Int64N(int64(2 * ttl)))
		select {
		case <-set.Done():
		case <-time.After(work):
		}
		_ = set.Release(context.Background())
	}
	_ = c.Close(context.Background())
}

// begin records the set's members as held from now until each member's
// context ends.
func (w *multiWorld) begin(set *sqllock.GuardSet) []*hold {
	now := time.Now()
	var hs []*hold
	w.mu.Lock()
	w.res.Grants++
	for _, g := range set.Guards() {
		h := &hold{key: g.Key(), owner: g.Lease().Owner, token: g.Token(), start: now}
		hs = append(hs, h)
		w.holds = append(w.holds, h)
	}
	w.mu.Unlock()
	for i, g := range set.Guards() {
		h := hs[i]
		w.wg.Go(func() {
			<-g.Done()
			w.end(h, time.Now())
		})
	}
	return hs
}

func (w *multiWorld) end(h *hold, at time.Time) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if h.end.IsZero() {
		h.end = at
	}
}

func (w *multiWorld) endAll(hs []*hold) {
	now := time.Now()
	for _, h := range hs {
		w.end(h, now)
	}
}

// check counts the pairs of holds of one key that overlap in time.
func (w *multiWorld) check() {
	byKey := map[string][]*hold{}
	for _, h := range w.holds {
		byKey[h.key] = append(byKey[h.key], h)
	}
	for _, k := range w.keys {
		hs := byKey[k]
		sort.Slice(hs, func(i, j int) bool { return hs[i].start.Before(hs[j].start) })
		for i := 1; i < len(hs); i++ {
			prev := hs[0] // the hold that ends last among those before i
			for _, h := range hs[1:i] {
				if h.end.IsZero() || !prev.end.IsZero() && h.end.After(prev.end) {
					prev = h
				}
			}
			if prev.end.IsZero() || hs[i].start.Before(prev.end) {
				w.res.Overlaps++
				if len(w.res.Examples) < 3 {
					w.res.Examples = append(w.res.Examples, fmt.Sprintf("two holders of %s: %s (token %d) from %v until %v, %s (token %d) from %v",
						k, prev.owner, prev.token, prev.start, prev.end, hs[i].owner, hs[i].token, hs[i].start))
				}
			}
		}
	}
}
