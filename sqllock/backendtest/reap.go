package backendtest

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// The rules of reaping ([sqllock.Reaper]). A backend that does not
// implement it skips them.

func reapTests() []struct {
	name string
	fn   func(t *testing.T, h Harness)
} {
	return []struct {
		name string
		fn   func(t *testing.T, h Harness)
	}{
		{"ReapedKeyContinuesAboveItsTokens", testReapedKeyContinues},
		{"ReapedKeyAtTheEndStaysExhausted", testReapedKeyExhausted},
		{"ReapNeverTakesAHeldKey", testReapNeverTakesHeld},
		{"ReapKeepsRecentKeys", testReapKeepsRecent},
		{"ReapLimitBoundsABatch", testReapLimit},
		{"ReapBadInputRefusedWithoutTrace", testReapBadInput},
		{"ReapedLeaseIsLost", testReapedLeaseIsLost},
		{"ReapRacesFirstGrants", testReapRacesFirstGrants},
		{"ReapRacesBatchRenewals", testReapRacesBatchRenewals},
		{"ReapedKeysOfASetContinue", testReapedKeysOfASet},
		{"ReapedSharedKeyContinues", testReapedSharedKey},
	}
}

func reaper(t *testing.T, b sqllock.Backend) sqllock.Reaper {
	t.Helper()
	r, ok := b.(sqllock.Reaper)
	if !ok {
		t.Skip("backend does not implement sqllock.Reaper")
	}
	return r
}

func reap(t *testing.T, r sqllock.Reaper, olderThan time.Duration, limit int) int {
	t.Helper()
	n, err := r.Reap(ctx(t), olderThan, limit)
	if err != nil {
		t.Fatalf("Reap(%v, %d): %v", olderThan, limit, err)
	}
	return n
}

// ended acquires key n times in a row (releasing each) and expires the
// last lease, so that the key is reapable at once; it returns the last
// token.
func ended(t *testing.T, h Harness, b sqllock.Backend, key string, n int) int64 {
	t.Helper()
	var l sqllock.Lease
	for i := range n {
		l = acquire(t, b, key, fmt.Sprintf("o%d", i))
		release(t, b, l)
	}
	h.Expire(t, b, key)
	return l.Token
}

func testReapedKeyContinues(t *testing.T, h Harness) {
	b := h.New(t)
	r := reaper(t, b)
	a := ended(t, h, b, "a", 3)
	z := ended(t, h, b, "z", 7)
	if n := reap(t, r, 0, 100); n != 2 {
		t.Fatalf("Reap = %d, want 2 (a and z ended)", n)
	}
	for _, k := range []string{"a", "z"} {
		if i, ok := info(t, b, k); ok {
			t.Fatalf("after Reap List shows %+v", i)
		}
	}
	l := acquire(t, b, "a", "again")
	if l.Token <= a {
		t.Fatalf("reaped key a acquired again: token %d, want > %d (its last token): G2", l.Token, a)
	}
	if l := acquire(t, b, "z", "again"); l.Token <= z {
		t.Fatalf("reaped key z acquired again: token %d, want > %d (its last token): G2", l.Token, z)
	}
	// Reaped twice: still above both tenures.
	release(t, b, l)
	h.Expire(t, b, "a")
	reap(t, r, 0, 100)
	if l2 := acquire(t, b, "a", "fourth"); l2.Token <= l.Token {
		t.Fatalf("key a reaped a second time: token %d, want > %d", l2.Token, l.Token)
	}
}

func testReapedKeyExhausted(t *testing.T, h Harness) {
	if h.SetToken == nil {
		t.Skip("Harness.SetToken is nil")
	}
	b := h.New(t)
	r := reaper(t, b)
	h.SetToken(t, b, "k", math.MaxInt64)
	h.Expire(t, b, "k")
	if n := reap(t, r, 0, 10); n != 1 {
		t.Fatalf("Reap = %d, want 1", n)
	}
	// Closed: no grant (memory says ErrTokenExhausted; a SQL backend's
	// first row cannot be above the floor, and its insert fails).
	l, err := b.TryAcquire(ctx(t), sqllock.AcquireRequest{Key: "k", TTL: ttl, Owner: "o"})
	if err == nil {
		t.Fatalf("acquire of a key reaped at MaxInt64 granted token %d, want a refusal (never a token from the start again)", l.Token)
	}
	if i, ok := info(t, b, "k"); ok && i.Held {
		t.Fatalf("after the refused acquire List = %+v, want no holder", i)
	}
}

func testReapNeverTakesHeld(t *testing.T, h Harness) {
	b := h.New(t)
	r := reaper(t, b)
	l := acquire(t, b, "held", "o1")
	rel := acquire(t, b, "released", "o1")
	release(t, b, rel) // its deadline is still ahead
	if n := reap(t, r, 0, 100); n != 0 {
		t.Fatalf("Reap = %d, want 0: a held key and a key released before its deadline", n)
	}
	if _, err := b.TryRenew(ctx(t), l, ttl); err != nil {
		t.Fatalf("renew of the held lease after Reap: %v", err)
	}
	held(t, b, "held", "o2")
	if i, ok := info(t, b, "released"); !ok || i.Token != rel.Token {
		t.Fatalf("released key after Reap: %+v, %v; want kept with token %d", i, ok, rel.Token)
	}
}

func testReapKeepsRecent(t *testing.T, h Harness) {
	b := h.New(t)
	r := reaper(t, b)
	ended(t, h, b, "k", 1)
	if n := reap(t, r, time.Hour, 100); n != 0 {
		t.Fatalf("Reap(1h) = %d, want 0: the key ended just now", n)
	}
	if _, ok := info(t, b, "k"); !ok {
		t.Fatal("Reap(1h) deleted a key that ended just now")
	}
}

func testReapLimit(t *testing.T, h Harness) {
	b := h.New(t)
	r := reaper(t, b)
	for i := range 5 {
		ended(t, h, b, fmt.Sprintf("k%d", i), 1)
	}
	for _, want := range []int{2, 2, 1, 0} {
		if n := reap(t, r, 0, 2); n != want {
			t.Fatalf("Reap(limit 2) = %d, want %d", n, want)
		}
	}
}

func testReapBadInput(t *testing.T, h Harness) {
	b := h.New(t)
	r := reaper(t, b)
	ended(t, h, b, "k", 1)
	for _, c := range []struct {
		olderThan time.Duration
		limit     int
	}{{-time.Nanosecond, 10}, {0, 0}, {0, -1}, {0, sqllock.MaxReapLimit + 1}} {
		n, err := r.Reap(ctx(t), c.olderThan, c.limit)
		if !errors.Is(err, sqllock.ErrInvalidReap) || n != 0 {
			t.Errorf("Reap(%v, %d) = %d, %v; want 0, ErrInvalidReap", c.olderThan, c.limit, n, err)
		}
	}
	if _, ok := info(t, b, "k"); !ok {
		t.Fatal("a refused Reap deleted a key")
	}
}

func testReapedLeaseIsLost(t *testing.T, h Harness) {
	b := h.New(t)
	r := reaper(t, b)
	l := acquire(t, b, "k", "o1")
	h.Expire(t, b, "k")
	if n := reap(t, r, 0, 10); n != 1 {
		t.Fatalf("Reap = %d, want 1 (an expired lease)", n)
	}
	if _, err := b.TryRenew(ctx(t), l, ttl); !errors.Is(err, sqllock.ErrLeaseLost) {
		t.Fatalf("renew of a reaped lease = %v, want ErrLeaseLost", err)
	}
	if err := b.Release(ctx(t), l); !errors.Is(err, sqllock.ErrLeaseLost) {
		t.Fatalf("release of a reaped lease = %v, want ErrLeaseLost", err)
	}
	if l2 := acquire(t, b, "k", "o2"); l2.Token <= l.Token {
		t.Fatalf("token after the reap %d, want > %d", l2.Token, l.Token)
	}
}

// testReapRacesFirstGrants runs reaps against acquires, releases and
// expiries of a few keys: every grant's token exceeds every token of its
// key whose grant had returned before it was asked for.
func testReapRacesFirstGrants(t *testing.T, h Harness) {
	b := h.New(t)
	r := reaper(t, b)
	const workers, rounds = 4, 60
	keys := []string{"a", "b", "c"}
	var mu sync.Mutex
	seen := map[string]int64{}
	stop := make(chan struct{})
	reaped := make(chan int)
	go func() {
		total := 0
		for {
			select {
			case <-stop:
				reaped <- total
				return
			default:
			}
			n, err := r.Reap(ctx(t), 0, 2)
			if err != nil {
				t.Errorf("Reap: %v", err)
			}
			total += n
		}
	}()
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			for i := range rounds {
				k := keys[rng.IntN(len(keys))]
				mu.Lock()
				before := seen[k]
				mu.Unlock()
				l, err := b.TryAcquire(ctx(t), sqllock.AcquireRequest{Key: k, TTL: ttl, Owner: fmt.Sprintf("w%d-%d", w, i)})
				if errors.Is(err, sqllock.ErrNotAcquired) || errors.Is(err, sqllock.ErrUnavailable) {
					continue
				}
				if err != nil {
					t.Errorf("TryAcquire(%q): %v", k, err)
					return
				}
				if l.Token <= before {
					t.Errorf("grant of %q: token %d, want > %d (a grant that had returned before): G2", k, l.Token, before)
				}
				mu.Lock()
				seen[k] = max(seen[k], l.Token)
				mu.Unlock()
				// Expired while held (so not yet reapable: the row is
				// there), then released, perhaps after a reap.
				h.Expire(t, b, k)
				if err := b.Release(ctx(t), l); err != nil && !errors.Is(err, sqllock.ErrLeaseLost) {
					t.Errorf("Release(%q): %v", k, err)
				}
			}
		})
	}
	wg.Wait()
	close(stop)
	if n := <-reaped; n == 0 {
		t.Error("no reap deleted anything: the race was not run")
	}
}

// testReapRacesBatchRenewals renews held leases in batches while a reaper
// runs: a held lease is never reaped, so every batch renews all of them.
func testReapRacesBatchRenewals(t *testing.T, h Harness) {
	b := h.New(t)
	r := reaper(t, b)
	br := batcher(t, b)
	var reqs []sqllock.RenewRequest
	for i := range 4 {
		reqs = append(reqs, sqllock.RenewRequest{Lease: acquire(t, b, fmt.Sprintf("h%d", i), "o"), TTL: ttl})
	}
	gone := acquire(t, b, "gone", "o")
	h.Expire(t, b, "gone")
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 20 {
			ended(t, h, b, fmt.Sprintf("e%d", i), 1)
			if _, err := r.Reap(ctx(t), 0, 3); err != nil {
				t.Errorf("Reap: %v", err)
			}
		}
	}()
	for range 20 {
		res := renewBatch(t, br, append(reqs, sqllock.RenewRequest{Lease: gone, TTL: ttl})...)
		for i, x := range res[:len(reqs)] {
			if x.Err != nil {
				t.Fatalf("batch renewal of held %q during reaps: %v", reqs[i].Lease.Key, x.Err)
			}
		}
		if !errors.Is(res[len(reqs)].Err, sqllock.ErrLeaseLost) {
			t.Fatalf("batch renewal of the expired (perhaps reaped) lease: %v, want ErrLeaseLost", res[len(reqs)].Err)
		}
	}
	<-done
}

// testReapedKeysOfASet: the all-or-nothing acquire of a set
// ([sqllock.MultiAcquirer]) inserts a reaped key's first row above every
// token it had, as a single acquire does.
func testReapedKeysOfASet(t *testing.T, h Harness) {
	b := h.New(t)
	r := reaper(t, b)
	ma, ok := b.(sqllock.MultiAcquirer)
	if !ok {
		t.Skip("backend does not implement sqllock.MultiAcquirer")
	}
	a := ended(t, h, b, "a", 3)
	z := ended(t, h, b, "z", 2)
	if n := reap(t, r, 0, 10); n != 2 {
		t.Fatalf("Reap = %d, want 2", n)
	}
	ls, err := ma.TryAcquireAll(ctx(t), sqllock.MultiAcquireRequest{Keys: []string{"a", "z"}, TTL: ttl, Owner: "set"})
	if err != nil {
		t.Fatalf("TryAcquireAll after the reap: %v", err)
	}
	last := map[string]int64{"a": a, "z": z}
	for _, l := range ls {
		if l.Token <= last[l.Key] {
			t.Errorf("key %q of a set after its reap: token %d, want > %d: G2", l.Key, l.Token, last[l.Key])
		}
	}
}

// testReapedSharedKey: a key read shared, then ended and reaped, continues
// above every token it and its reader slots had, read shared again as
// well as taken exclusive; a reaper leaves reader slots alone (their
// numbering is the key's own), so a key read again and again never runs
// out of slots.
func testReapedSharedKey(t *testing.T, h Harness) {
	if !h.Shared {
		t.Skip("backend does not grant shared requests")
	}
	b := h.New(t)
	r := reaper(t, b)
	var last int64
	for round := range 3 {
		r1 := acquireShared(t, b, "k", fmt.Sprintf("r1-%d", round))
		r2 := acquireShared(t, b, "k", fmt.Sprintf("r2-%d", round))
		if r1.Token <= last || r2.Token <= last {
			t.Fatalf("round %d: shared grants at tokens %d, %d after a reap of a key that had %d: G2", round, r1.Token, r2.Token, last)
		}
		release(t, b, r1)
		release(t, b, r2)
		expireAll(t, h, b, "k")
		last = max(r1.Token, r2.Token)
		reap(t, r, 0, 100)
		if _, ok := info(t, b, "k"); ok {
			t.Fatalf("round %d: k ended, yet not reaped", round)
		}
		for _, i := range mustList(t, b, "k") {
			if _, _, ok := sqllock.ParseSharedKey(i.Key); !ok {
				t.Fatalf("round %d: %q left after the reap", round, i.Key)
			}
		}
	}
	w := acquire(t, b, "k", "w")
	if w.Token <= last {
		t.Fatalf("exclusive grant at token %d after a reap of a key read up to %d: G2", w.Token, last)
	}
	// While a key is read, a reader slot freed long ago is taken again
	// after a reap, not a new one: slots reaped under a key that stays
	// would use up its numbering (sqllock.MaxShared).
	r0 := acquireShared(t, b, "s", "r0")
	r1 := acquireShared(t, b, "s", "r1")
	release(t, b, r1)
	h.Expire(t, b, r1.Key)
	reap(t, r, 0, 100)
	if r2 := acquireShared(t, b, "s", "r2"); r2.Key != r1.Key {
		t.Fatalf("a reader after a reap got slot %q, want the freed %q again (reader %q holds)", r2.Key, r1.Key, r0.Key)
	}
}

func mustList(t *testing.T, b sqllock.Backend, prefix string) []sqllock.LockInfo {
	t.Helper()
	all, err := b.List(ctx(t), prefix)
	if err != nil {
		t.Fatal(err)
	}
	return all
}
