package sim

import (
	"context"

	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"time"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

// The shared-lock simulation (SIM-SHARED): readers and writers on a few
// keys of the memory backend, each client behind a faulty link of its own
// (lost replies after the operation was applied, delays, pauses that stall
// its calls past its TTL, crashes after which nothing it sends arrives),
// inside a testing/synctest bubble. Every operation the backend applied is
// logged with the backend's time (the bubble's clock: nothing moves it
// during an operation), and CheckShared reads that log:
//
//   - S-EXCL: at no instant of the backend's clock is an exclusive tenure
//     of a key beside any other tenure of it (shared or exclusive); a
//     tenure runs from its grant to the earlier of its release and its last
//     applied deadline;
//   - S-TOKEN: an exclusive grant's token is above every token granted on
//     its key before it, a shared grant's above the last exclusive one's;
//   - S-STARVE: in a run with Starve set, the one writer, waiting while
//     readers keep arriving, is granted within the readers' TTL plus a
//     poll of its wait's start.

// SharedConfig is one run of the shared-lock simulation.
type SharedConfig struct {
	Seed uint64
	// Starve runs the starvation scenario: readers that keep arriving on
	// one key, each holding a while, and one writer that waits for it; no
	// faults.
	Starve bool
}

// SharedEvent is one applied operation, by the backend's clock.
type SharedEvent struct {
	At       time.Time // the backend's clock
	Kind     string    // "grant", "renew", "release"
	Key      string    // the key (a reader's slot key for a shared lease)
	Of       string    // the locked key
	Shared   bool
	Token    int64
	Owner    string
	Deadline time.Time // grant, renew
}

// SharedResult is a run's record.
type SharedResult struct {
	Events []SharedEvent
	// WriterWaits are the starvation scenario's writer waits: from the
	// wait's start to its grant.
	WriterWaits []time.Duration
	Grants      [2]int // shared, exclusive
	ReaderTTL   time.Duration
}

// link is one client's view of the backend: its faults, and the log.
type link struct {
	*memory.Backend
	log     *sharedLog
	rng     *rand.Rand
	mu      sync.Mutex // guards rng, dead, stallTo
	faults  bool
	dead    bool
	stallTo time.Time
}

type sharedLog struct {
	mu     sync.Mutex
	events []SharedEvent
}

func (l *sharedLog) add(e SharedEvent) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.events = append(l.events, e)
}

// before is a call's fault on the way there: a crashed client's call
// never arrives; a stalled one waits out the stall.
func (k *link) before(ctx context.Context) error {
	k.mu.Lock()
	dead, stall := k.dead, time.Until(k.stallTo)
	k.mu.Unlock()
	if dead {
		return fmt.Errorf("%w: crashed", sqllock.ErrUnavailable)
	}
	if stall > 0 {
		select {
		case <-time.After(stall):
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return nil
}

// lost reports whether an applied call's reply is lost.
func (k *link) lost() bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.faults && k.rng.IntN(10) == 0
}

func of(key string) (string, bool) {
	if k, _, ok := sqllock.ParseSharedKey(key); ok {
		return k, true
	}
	return key, false
}

func (k *link) TryAcquire(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	if err := k.before(ctx); err != nil {
		return sqllock.Lease{}, err
	}
	l, err := k.Backend.TryAcquire(ctx, req)
	if err != nil {
		return l, err
	}
	k.log.add(SharedEvent{At: l.BackendTime, Kind: "grant", Key: l.Key, Of: req.Key, Shared: req.Shared, Token: l.Token, Owner: l.Owner, Deadline: l.Deadline})
	if k.lost() {
		return sqllock.Lease{}, fmt.Errorf("%w: reply lost", sqllock.ErrIndeterminate)
	}
	return l, nil
}

func (k *link) TryRenew(ctx context.Context, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
	if err := k.before(ctx); err != nil {
		return sqllock.Lease{}, err
	}
	nl, err := k.Backend.TryRenew(ctx, l, ttl)
	if err != nil {
		return nl, err
	}
	key, shared := of(l.Key)
	k.log.add(SharedEvent{At: nl.BackendTime, Kind: "renew", Key: l.Key, Of: key, Shared: shared, Token: l.Token, Owner: l.Owner, Deadline: nl.Deadline})
	if k.lost() {
		return sqllock.Lease{}, fmt.Errorf("%w: reply lost", sqllock.ErrUnavailable)
	}
	return nl, nil
}

// TryRenewBatch renews one by one through TryRenew, so that every renewal
// is logged and faulted (the memory backend's own would be promoted).
func (k *link) TryRenewBatch(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
	if err := sqllock.ValidateRenewBatch(reqs); err != nil {
		return nil, err
	}
	out := make([]sqllock.RenewResult, len(reqs))
	for i, r := range reqs {
		out[i].Lease, out[i].Err = k.TryRenew(ctx, r.Lease, r.TTL)
	}
	return out, nil
}

func (k *link) Release(ctx context.Context, l sqllock.Lease) error {
	if err := k.before(ctx); err != nil {
		return err
	}
	now := time.Now() // the backend's clock: nothing moves it in the bubble during the call
	err := k.Backend.Release(ctx, l)
	key, shared := of(l.Key)
	// Logged whatever the outcome: a release of a lease no longer
	// current changes nothing, and the checker ends only the tenure of
	// that very token.
	k.log.add(SharedEvent{At: now, Kind: "release", Key: l.Key, Of: key, Shared: shared, Token: l.Token, Owner: l.Owner})
	if err == nil && k.lost() {
		return fmt.Errorf("%w: reply lost", sqllock.ErrIndeterminate)
	}
	return err
}

// RunShared runs one seed of the shared-lock simulation. Call it inside a
// testing/synctest bubble.
func RunShared(cfg SharedConfig) *SharedResult {
	rng := rand.New(rand.NewPCG(cfg.Seed, 0x5ea7ed))
	mem := memory.New()
	log := &sharedLog{}
	res := &SharedResult{ReaderTTL: 2 * time.Second}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	var mu sync.Mutex // guards res's counters
	// newLink is a client's link, its faults drawn from r (the calling
	// goroutine's own).
	newLink := func(r *rand.Rand, faults bool) *link {
		return &link{Backend: mem, log: log, rng: rand.New(rand.NewPCG(r.Uint64(), 1)), faults: faults}
	}
	session := func(k *link, key string, shared bool, ttl, work, wait time.Duration) (ok bool) {
		c, err := sqllock.New(k, sqllock.Options{TTL: ttl, Owner: "sim"})
		if err != nil {
			panic(err)
		}
		defer c.Close(context.Background())
		g, err := c.Acquire(ctx, key, &sqllock.AcquireOptions{Shared: shared, Wait: wait})
		if err != nil {
			return false
		}
		mu.Lock()
		if shared {
			res.Grants[0]++
		} else {
			res.Grants[1]++
		}
		mu.Unlock()
		select {
		case <-time.After(work):
		case <-g.Done():
		case <-ctx.Done():
		}
		_ = g.Release(context.Background())
		return true
	}
	const run = 40 * time.Second
	if cfg.Starve {
		// Readers keep arriving: each holds 600ms, one every 200ms, so
		// that some reader holds the key at every instant.
		for r := range 3 {
			seed := rng.Uint64()
			wg.Go(func() {
				time.Sleep(time.Duration(r) * 200 * time.Millisecond)
				k := newLink(rand.New(rand.NewPCG(seed, 3)), false)
				for ctx.Err() == nil {
					session(k, "k0", true, res.ReaderTTL, 600*time.Millisecond, sqllock.WaitForever)
				}
			})
		}
		wseed := rng.Uint64()
		wg.Go(func() {
			r := rand.New(rand.NewPCG(wseed, 4))
			k := newLink(r, false)
			for ctx.Err() == nil {
				time.Sleep(time.Duration(1000+r.IntN(2000)) * time.Millisecond)
				start := time.Now()
				if session(k, "k0", false, res.ReaderTTL, 100*time.Millisecond, sqllock.WaitForever) {
					mu.Lock()
					res.WriterWaits = append(res.WriterWaits, time.Since(start)-100*time.Millisecond)
					mu.Unlock()
				}
			}
		})
	} else {
		keys := []string{"k0", "k1"}
		for i := range 8 {
			seed := rng.Uint64()
			wg.Go(func() {
				r := rand.New(rand.NewPCG(seed, 2))
				for ctx.Err() == nil {
					k := newLink(r, true)
					shared := i%4 != 0
					ttl := time.Duration(1+r.IntN(3)) * time.Second
					work := time.Duration(r.IntN(3000)) * time.Millisecond
					switch r.IntN(6) {
					case 0: // a crash some time into the session
						at := time.Duration(r.IntN(2000)) * time.Millisecond
						time.AfterFunc(at, func() { k.mu.Lock(); k.dead = true; k.mu.Unlock() })
					case 1: // a pause past the TTL
						at := time.Duration(r.IntN(1000)) * time.Millisecond
						time.AfterFunc(at, func() { k.mu.Lock(); k.stallTo = time.Now().Add(2 * ttl); k.mu.Unlock() })
					}
					session(k, keys[r.IntN(len(keys))], shared, ttl, work, time.Duration(r.IntN(5000))*time.Millisecond)
					time.Sleep(time.Duration(r.IntN(300)) * time.Millisecond)
				}
			})
		}
	}
	time.Sleep(run)
	cancel()
	wg.Wait()
	log.mu.Lock()
	res.Events = append([]SharedEvent(nil), log.events...)
	log.mu.Unlock()
	return res
}

// CheckShared returns the violations of S-EXCL, S-TOKEN and (in a Starve
// run) S-STARVE in res, as messages; none for a correct run.
func CheckShared(res *SharedResult, starve bool) []string {
	var bad []string
	type tenure struct {
		start, end time.Time
		shared     bool
		token      int64
		owner      string
	}
	evs := append([]SharedEvent(nil), res.Events...)
	sort.SliceStable(evs, func(i, j int) bool { return evs[i].At.Before(evs[j].At) })
	// S-TOKEN, in application order (the log's order per key is the
	// backend's, as every call is logged under the call).
	maxTok, lastExcl := map[string]int64{}, map[string]int64{}
	seen := map[string]bool{} // slot key + token: a retry's re-grant
	for _, e := range res.Events {
		if e.Kind != "grant" {
			continue
		}
		id := fmt.Sprint(e.Key, "#", e.Token)
		if seen[id] {
			continue
		}
		seen[id] = true
		switch {
		case !e.Shared && e.Token <= maxTok[e.Of]:
			bad = append(bad, fmt.Sprintf("S-TOKEN: exclusive grant of %s at %v: token %d, not above %d granted before", e.Of, e.At, e.Token, maxTok[e.Of]))
		case e.Shared && e.Token <= lastExcl[e.Of]:
			bad = append(bad, fmt.Sprintf("S-TOKEN: shared grant of %s at %v: token %d, not above the last exclusive %d", e.Of, e.At, e.Token, lastExcl[e.Of]))
		}
		maxTok[e.Of] = max(maxTok[e.Of], e.Token)
		if !e.Shared {
			lastExcl[e.Of] = e.Token
		}
	}
	// S-EXCL: tenures per locked key.
	open := map[string]*tenure{} // by lease key + token
	byKey := map[string][]*tenure{}
	for _, e := range evs {
		id := fmt.Sprint(e.Key, "#", e.Token)
		switch e.Kind {
		case "grant":
			if t := open[id]; t != nil {
				t.end = later(t.end, e.Deadline) // a retry's re-grant
				continue
			}
			t := &tenure{start: e.At, end: e.Deadline, shared: e.Shared, token: e.Token, owner: e.Owner}
			open[id] = t
			byKey[e.Of] = append(byKey[e.Of], t)
		case "renew":
			if t := open[id]; t != nil && e.At.Before(t.end) {
				t.end = later(t.end, e.Deadline)
			}
		case "release":
			if t := open[id]; t != nil && e.At.Before(t.end) {
				t.end = e.At
			}
		}
	}
	for key, ts := range byKey {
		for i, a := range ts {
			if a.shared {
				continue
			}
			for j, b := range ts {
				if i != j && a.start.Before(b.end) && b.start.Before(a.end) {
					bad = append(bad, fmt.Sprintf("S-EXCL: %s: exclusive token %d [%v, %v) beside %s token %d [%v, %v)",
						key, a.token, a.start, a.end, map[bool]string{true: "shared", false: "exclusive"}[b.shared], b.token, b.start, b.end))
				}
			}
		}
	}
	if starve {
		bound := res.ReaderTTL + 500*time.Millisecond // the readers' TTL, a poll, the writer's own hold margin
		for _, w := range res.WriterWaits {
			if w > bound {
				bad = append(bad, fmt.Sprintf("S-STARVE: the writer waited %v, more than the readers' TTL and a poll (%v)", w, bound))
			}
		}
		if len(res.WriterWaits) == 0 {
			bad = append(bad, "S-STARVE: the writer was never granted")
		}
	}
	return bad
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
