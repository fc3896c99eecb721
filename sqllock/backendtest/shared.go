package backendtest

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// testShared checks the rules of shared locks ([sqllock.AcquireRequest]
// Shared and Mark), each on a backend of its own, when the harness says
// the backend grants shared requests; otherwise that it refuses them
// before any I/O.
func testShared(t *testing.T, h Harness) {
	if !h.Shared {
		testSharedRefused(t, h)
		return
	}
	tests := []struct {
		name string
		fn   func(t *testing.T, h Harness, b sqllock.Backend)
	}{
		{"SharedBesideShared", testSharedBesideShared},
		{"ExclusiveRefusesShared", testExclusiveRefusesShared},
		{"TokenOrder", testSharedTokenOrder},
		{"LastReleaseFreesKey", testSharedLastRelease},
		{"SameOwnerRetryGetsSameGrant", testSharedSameOwner},
		{"RenewKeepsTokenAndKeyDeadline", testSharedRenew},
		{"ExpiryEndsAReader", testSharedExpiry},
		{"ForcedReleaseOfKeyEndsReaders", testSharedForcedRelease},
		{"MarkBlocksNewReaders", testSharedMark},
		{"MarkExpires", testSharedMarkExpires},
		{"PlainRefusalLeavesNoMark", testSharedNoMarkWithoutWait},
		{"BadInputRefusedWithoutTrace", testSharedBadInput},
		{"RaceNeverExclusiveBesideAny", testSharedRace},
		{"WatchSignalsLastRelease", testSharedWatch},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			tt.fn(t, h, h.New(t))
		})
	}
}

func sharedReq(key, owner string) sqllock.AcquireRequest {
	return sqllock.AcquireRequest{Key: key, TTL: ttl, Owner: owner, Shared: true}
}

// acquireShared takes key shared for owner, checking the lease's shape.
func acquireShared(t *testing.T, b sqllock.Backend, key, owner string) sqllock.Lease {
	t.Helper()
	l, err := b.TryAcquire(ctx(t), sharedReq(key, owner))
	if err != nil {
		t.Fatalf("TryAcquire(%q, %q, shared): %v", key, owner, err)
	}
	k, i, ok := sqllock.ParseSharedKey(l.Key)
	if !ok || k != key || i < 1 || l.Owner != owner || l.Token <= 0 {
		t.Fatalf("TryAcquire(%q, %q, shared) = %+v: not a reader slot of %q for %q", key, owner, l, key, owner)
	}
	if got := l.Deadline.Sub(l.BackendTime); got < ttl || got > ttl+time.Millisecond {
		t.Errorf("shared lease's Deadline - BackendTime = %v, want TTL %v", got, ttl)
	}
	return l
}

// refusedShared checks that a shared request of key is refused.
func refusedShared(t *testing.T, b sqllock.Backend, key, owner string) *sqllock.HeldError {
	t.Helper()
	_, err := b.TryAcquire(ctx(t), sharedReq(key, owner))
	var he *sqllock.HeldError
	if !errors.Is(err, sqllock.ErrNotAcquired) || !errors.As(err, &he) {
		t.Fatalf("TryAcquire(%q, %q, shared) = %v, want a *HeldError matching ErrNotAcquired", key, owner, err)
	}
	return he
}

// marking sends a waiting writer's exclusive request (Mark) and returns
// its error (nil: granted).
func marking(t *testing.T, b sqllock.Backend, key, owner string, d time.Duration) (sqllock.Lease, error) {
	t.Helper()
	return b.TryAcquire(ctx(t), sqllock.AcquireRequest{Key: key, TTL: d, Owner: owner, Mark: true})
}

// expireAll makes key and every reader slot of it expire, as a TTL
// passing would.
func expireAll(t *testing.T, h Harness, b sqllock.Backend, key string) {
	t.Helper()
	all, err := b.List(ctx(t), key)
	if err != nil {
		t.Fatal(err)
	}
	for _, i := range all {
		if k, _, ok := sqllock.ParseSharedKey(i.Key); ok && k == key {
			h.Expire(t, b, i.Key)
		}
	}
	h.Expire(t, b, key)
}

func testSharedRefused(t *testing.T, h Harness) {
	b := h.New(t)
	for _, req := range []sqllock.AcquireRequest{sharedReq("k", "o"), {Key: "k", TTL: ttl, Owner: "o", Shared: true, MinHold: ttl}} {
		if _, err := b.TryAcquire(ctx(t), req); !errors.Is(err, sqllock.ErrSharedUnsupported) {
			t.Fatalf("TryAcquire(shared) on a backend without shared grants = %v, want ErrSharedUnsupported", err)
		}
	}
	if all, err := b.List(ctx(t), ""); err != nil || len(all) != 0 {
		t.Fatalf("List after refused shared requests = %+v, %v; want nothing", all, err)
	}
}

func testSharedBesideShared(t *testing.T, h Harness, b sqllock.Backend) {
	r1 := acquireShared(t, b, "k", "r1")
	r2 := acquireShared(t, b, "k", "r2")
	if r1.Key == r2.Key || r2.Token <= r1.Token {
		t.Fatalf("two shared grants %+v, %+v: want distinct slots and increasing tokens", r1, r2)
	}
	he := held(t, b, "k", "w")
	if he.Shared != 2 || he.Owner != "" || he.Remaining <= 0 || he.Remaining > ttl {
		t.Fatalf("exclusive refusal beside 2 readers = %+v, want Shared 2, no owner, remaining in (0, TTL]", he)
	}
	i, _ := info(t, b, "k")
	if !i.Held || i.Shared != 2 || i.Owner != "" || i.Token != r2.Token {
		t.Fatalf("List(k) = %+v, want held shared by 2 at token %d", i, r2.Token)
	}
	for _, r := range []sqllock.Lease{r1, r2} {
		if ri, ok := info(t, b, r.Key); !ok || !ri.Held || ri.Owner != r.Owner || ri.Token != r.Token {
			t.Fatalf("List(%s) = %+v, want held by %s", r.Key, ri, r.Owner)
		}
	}
	// Keys are independent: another key is free.
	acquire(t, b, "other", "w")
}

func testExclusiveRefusesShared(t *testing.T, h Harness, b sqllock.Backend) {
	w := acquire(t, b, "k", "w")
	he := refusedShared(t, b, "k", "r")
	if he.Owner != "w" || he.Token != w.Token || he.Shared != 0 || he.Remaining <= 0 || he.Remaining > ttl {
		t.Fatalf("shared refusal beside a writer = %+v, want owner w, token %d", he, w.Token)
	}
	release(t, b, w)
	acquireShared(t, b, "k", "r")
}

func testSharedTokenOrder(t *testing.T, h Harness, b sqllock.Backend) {
	w1 := acquire(t, b, "k", "w1")
	release(t, b, w1)
	r1 := acquireShared(t, b, "k", "r1")
	r2 := acquireShared(t, b, "k", "r2")
	if r1.Token <= w1.Token || r2.Token <= w1.Token {
		t.Fatalf("shared tokens %d, %d not above the last exclusive token %d", r1.Token, r2.Token, w1.Token)
	}
	release(t, b, r2) // the later reader leaves first
	r3 := acquireShared(t, b, "k", "r3")
	if r3.Token <= r2.Token {
		t.Fatalf("shared token %d not above the earlier %d", r3.Token, r2.Token)
	}
	release(t, b, r1)
	release(t, b, r3)
	w2 := acquire(t, b, "k", "w2")
	if w2.Token <= r3.Token {
		t.Fatalf("exclusive token %d not above every earlier token (reader %d)", w2.Token, r3.Token)
	}
	release(t, b, w2)
	// Readers that expired rather than released: the writer's token is
	// above theirs too, and their slots' next tokens above the writer's.
	r4 := acquireShared(t, b, "k", "r4")
	expireAll(t, h, b, "k")
	w3 := acquire(t, b, "k", "w3")
	if w3.Token <= r4.Token {
		t.Fatalf("exclusive token %d not above the expired reader's %d", w3.Token, r4.Token)
	}
	release(t, b, w3)
	r5 := acquireShared(t, b, "k", "r5")
	if r5.Token <= w3.Token {
		t.Fatalf("shared token %d not above the last exclusive %d", r5.Token, w3.Token)
	}
	if _, err := b.TryRenew(ctx(t), r4, ttl); err == nil {
		t.Fatalf("renewal of an expired reader %+v succeeded after a writer", r4)
	}
}

func testSharedLastRelease(t *testing.T, h Harness, b sqllock.Backend) {
	r1 := acquireShared(t, b, "k", "r1")
	r2 := acquireShared(t, b, "k", "r2")
	release(t, b, r1)
	held(t, b, "k", "w") // r2 still reads
	release(t, b, r2)
	w := acquire(t, b, "k", "w")
	// The old readers are gone for good.
	for _, r := range []sqllock.Lease{r1, r2} {
		if _, err := b.TryRenew(ctx(t), r, ttl); err == nil {
			t.Fatalf("renewal of released reader %s succeeded beside writer", r.Key)
		}
	}
	refusedShared(t, b, "k", "r3")
	release(t, b, w)
	// Releasing twice is harmless, and does not free the key under a
	// later reader.
	r4 := acquireShared(t, b, "k", "r4")
	if err := b.Release(ctx(t), r1); err != nil && !errors.Is(err, sqllock.ErrLeaseLost) {
		t.Fatalf("second release of a reader: %v", err)
	}
	held(t, b, "k", "w2")
	release(t, b, r4)
}

func testSharedSameOwner(t *testing.T, h Harness, b sqllock.Backend) {
	r1 := acquireShared(t, b, "k", "r1")
	again := acquireShared(t, b, "k", "r1")
	if again.Key != r1.Key || again.Token != r1.Token {
		t.Fatalf("same-owner repeat = %+v, want the grant %+v again", again, r1)
	}
	if i, _ := info(t, b, "k"); i.Shared != 1 {
		t.Fatalf("a repeat counted as a second reader: %+v", i)
	}
	release(t, b, r1)
	acquire(t, b, "k", "w")
}

func testSharedRenew(t *testing.T, h Harness, b sqllock.Backend) {
	req := sharedReq("k", "r1")
	req.TTL = time.Second
	r1, err := b.TryAcquire(ctx(t), req)
	if err != nil {
		t.Fatal(err)
	}
	n, err := b.TryRenew(ctx(t), r1, ttl)
	if err != nil {
		t.Fatalf("renew of a reader: %v", err)
	}
	if n.Token != r1.Token || n.Key != r1.Key || n.Deadline.Sub(n.BackendTime) < ttl {
		t.Fatalf("renewed reader %+v, want token %d and TTL %v", n, r1.Token, ttl)
	}
	// The key stays held shared at least as long as its reader.
	if i, _ := info(t, b, "k"); !i.Held || i.Deadline.Before(n.Deadline) {
		t.Fatalf("key's deadline %v before its renewed reader's %v: %+v", i.Deadline, n.Deadline, i)
	}
	if br, ok := b.(sqllock.BatchRenewer); ok {
		r2 := acquireShared(t, b, "k", "r2")
		res, err := br.TryRenewBatch(ctx(t), []sqllock.RenewRequest{{Lease: r2, TTL: 2 * ttl}, {Lease: n, TTL: ttl}})
		if err != nil || res[0].Err != nil || res[1].Err != nil {
			t.Fatalf("batch renewal of readers: %v %+v", err, res)
		}
		if i, _ := info(t, b, "k"); i.Deadline.Before(res[0].Lease.Deadline) {
			t.Fatalf("key's deadline %v before its batch-renewed reader's %v", i.Deadline, res[0].Lease.Deadline)
		}
	}
}

func testSharedExpiry(t *testing.T, h Harness, b sqllock.Backend) {
	r1 := acquireShared(t, b, "k", "r1")
	r2 := acquireShared(t, b, "k", "r2")
	h.Expire(t, b, r1.Key)
	_, err := b.TryRenew(ctx(t), r1, ttl)
	lost(t, err, "renew of an expired reader", sqllock.LostExpired)
	held(t, b, "k", "w") // r2 still reads
	r3 := acquireShared(t, b, "k", "r3")
	if i, _ := info(t, b, "k"); i.Shared != 2 {
		t.Fatalf("after one expired reader and one new: %d readers counted, want 2 (%+v)", i.Shared, i)
	}
	release(t, b, r2)
	release(t, b, r3)
	acquire(t, b, "k", "w")
}

func testSharedForcedRelease(t *testing.T, h Harness, b sqllock.Backend) {
	acquireShared(t, b, "k", "r0") // its slot is taken again below: r1's is not
	r1 := acquireShared(t, b, "k", "r1")
	i, _ := info(t, b, "k")
	if err := b.Release(ctx(t), sqllock.Lease{Key: "k", Token: i.Token, Owner: "admin"}); err != nil && !errors.Is(err, sqllock.ErrLeaseLost) {
		t.Fatalf("forced release of a key held shared: %v", err)
	}
	_, err := b.TryRenew(ctx(t), r1, ttl)
	lost(t, err, "renew of a reader after a forced release of its key", sqllock.LostReleased)
	// A new epoch: the old reader stays lost.
	r2 := acquireShared(t, b, "k", "r2")
	if _, err := b.TryRenew(ctx(t), r1, 5*ttl); err == nil {
		t.Fatalf("reader of an ended epoch renewed beside %+v", r2)
	}
	if i, _ := info(t, b, "k"); i.Deadline.After(r2.Deadline) {
		t.Fatalf("a lost reader's renewal moved its key's deadline to %v, past its live reader's %v", i.Deadline, r2.Deadline)
	}
	release(t, b, r2)
	acquire(t, b, "k", "w")
}

func testSharedMark(t *testing.T, h Harness, b sqllock.Backend) {
	r1 := acquireShared(t, b, "k", "r1")
	_, err := marking(t, b, "k", "w", ttl)
	var he *sqllock.HeldError
	if !errors.As(err, &he) || he.Shared != 1 {
		t.Fatalf("waiting writer beside a reader = %v, want a refusal naming 1 reader", err)
	}
	if i, _ := info(t, b, "k"); i.WaitingWriter != "w" {
		t.Fatalf("List after a waiting writer's attempt = %+v, want WaitingWriter w", i)
	}
	he = refusedShared(t, b, "k", "r2")
	if he.WaitingWriter != "w" || he.Remaining <= 0 || he.Remaining > ttl {
		t.Fatalf("reader refused by a mark = %+v, want WaitingWriter w", he)
	}
	// Another writer's attempt leaves the first's mark.
	if _, err := marking(t, b, "k", "w2", ttl); !errors.Is(err, sqllock.ErrNotAcquired) {
		t.Fatal(err)
	}
	if i, _ := info(t, b, "k"); i.WaitingWriter != "w" {
		t.Fatalf("a second writer replaced the first's mark: %+v", i)
	}
	release(t, b, r1)
	w, err := marking(t, b, "k", "w", ttl)
	if err != nil {
		t.Fatalf("waiting writer after the last reader left: %v", err)
	}
	if w.Token <= r1.Token {
		t.Fatalf("writer token %d not above the reader's %d", w.Token, r1.Token)
	}
	if i, _ := info(t, b, "k"); i.WaitingWriter != "" {
		t.Fatalf("the writer holds, yet its mark stays: %+v", i)
	}
	release(t, b, w)
	acquireShared(t, b, "k", "r3")
}

func testSharedMarkExpires(t *testing.T, h Harness, b sqllock.Backend) {
	r1 := acquireShared(t, b, "k", "r1")
	const d = 300 * time.Millisecond
	start := time.Now()
	if _, err := marking(t, b, "k", "w", d); !errors.Is(err, sqllock.ErrNotAcquired) {
		t.Fatal(err)
	}
	marked := time.Now() // the mark ends by then + d at the latest
	_, err := b.TryAcquire(ctx(t), sharedReq("k", "r2"))
	if time.Since(start) < d && !errors.Is(err, sqllock.ErrNotAcquired) {
		t.Fatalf("a reader inside the writer's mark: %v, want refused", err)
	}
	if err == nil {
		t.Skip("the machine is too slow to see the mark before its deadline")
	}
	time.Sleep(time.Until(marked.Add(d + 20*time.Millisecond + h.MarkRoundUp))) // the writer crashed: its mark ends by itself
	acquireShared(t, b, "k", "r2")
	if i, _ := info(t, b, "k"); i.WaitingWriter != "" || i.Shared != 2 {
		t.Fatalf("after the mark's deadline: %+v, want 2 readers and no mark", i)
	}
	release(t, b, r1)
}

func testSharedNoMarkWithoutWait(t *testing.T, h Harness, b sqllock.Backend) {
	acquireShared(t, b, "k", "r1")
	held(t, b, "k", "w")
	if i, _ := info(t, b, "k"); i.WaitingWriter != "" {
		t.Fatalf("a one-shot exclusive attempt marked the key: %+v", i)
	}
	acquireShared(t, b, "k", "r2")
}

func testSharedBadInput(t *testing.T, h Harness, b sqllock.Backend) {
	acquireShared(t, b, "k", "r1")
	before, _ := b.List(ctx(t), "")
	long := strings.Repeat("k", sqllock.MaxKeyLen-len(sqllock.SharedKey("", 9)))
	cases := []struct {
		name string
		req  sqllock.AcquireRequest
		want error
	}{
		{"MinHold", sqllock.AcquireRequest{Key: "k", TTL: ttl, Owner: "o", Shared: true, MinHold: ttl}, sqllock.ErrMinHoldUnsupported},
		{"Mark", sqllock.AcquireRequest{Key: "k", TTL: ttl, Owner: "o", Shared: true, Mark: true}, sqllock.ErrInvalidOption},
		{"KeyIsASlot", sharedReq(sqllock.SharedKey("k", 1), "o"), sqllock.ErrInvalidKey},
		{"SlotKeysTooLong", sharedReq(long, "o"), sqllock.ErrInvalidKey},
		{"EmptyKey", sharedReq("", "o"), sqllock.ErrInvalidKey},
		{"EmptyOwner", sharedReq("k", ""), sqllock.ErrInvalidOwner},
		{"BadTTL", sqllock.AcquireRequest{Key: "k", Owner: "o", Shared: true}, sqllock.ErrInvalidTTL},
		{"ExclusiveOfASlot", sqllock.AcquireRequest{Key: sqllock.SharedKey("k", 1), TTL: ttl, Owner: "o"}, sqllock.ErrInvalidKey},
	}
	for _, c := range cases {
		if _, err := b.TryAcquire(ctx(t), c.req); !errors.Is(err, c.want) {
			t.Errorf("%s: TryAcquire = %v, want %v", c.name, err, c.want)
		}
	}
	after, _ := b.List(ctx(t), "")
	if fmt.Sprint(strip(before)) != fmt.Sprint(strip(after)) {
		t.Fatalf("bad input left a trace:\nbefore %+v\nafter  %+v", before, after)
	}
}

// testSharedRace runs readers and writers on one key at once and checks,
// by the leases they were granted, that no writer ever held beside
// another holder: each records its hold between the grant's reply and
// its release's call, inside the hold at the backend.
func testSharedRace(t *testing.T, h Harness, b sqllock.Backend) {
	var (
		mu               sync.Mutex
		readers, writers int
		grants           [2]int
		bad              []string
	)
	const workers, rounds = 8, 40
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for r := range rounds {
				shared := rand.IntN(3) > 0
				req := sqllock.AcquireRequest{Key: "k", TTL: ttl, Owner: fmt.Sprintf("c%d-%d", w, r), Shared: shared, Mark: !shared && rand.IntN(2) == 0}
				l, err := b.TryAcquire(ctx(t), req)
				if errors.Is(err, sqllock.ErrNotAcquired) {
					continue
				}
				if err != nil {
					mu.Lock()
					bad = append(bad, err.Error())
					mu.Unlock()
					return
				}
				mu.Lock()
				if shared {
					readers++
					grants[0]++
					if writers > 0 {
						bad = append(bad, fmt.Sprintf("reader %s granted beside a writer", req.Owner))
					}
				} else {
					writers++
					grants[1]++
					if writers > 1 || readers > 0 {
						bad = append(bad, fmt.Sprintf("writer %s granted beside %d readers and %d writers", req.Owner, readers, writers-1))
					}
				}
				mu.Unlock()
				time.Sleep(time.Duration(rand.IntN(200)) * time.Microsecond)
				mu.Lock()
				if shared {
					readers--
				} else {
					writers--
				}
				mu.Unlock()
				if err := b.Release(ctx(t), l); err != nil {
					mu.Lock()
					bad = append(bad, fmt.Sprintf("release of %s: %v", l.Key, err))
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	if len(bad) > 0 {
		t.Fatalf("%d violations, the first: %v", len(bad), bad[:min(len(bad), 5)])
	}
	if grants[0] == 0 || grants[1] == 0 {
		t.Logf("grants: %d shared, %d exclusive", grants[0], grants[1])
	}
}

func testSharedWatch(t *testing.T, h Harness, b sqllock.Backend) {
	w, ok := b.(sqllock.Watcher)
	if !ok {
		t.Skip("backend does not implement sqllock.Watcher")
	}
	r1 := acquireShared(t, b, "k", "r1")
	r2 := acquireShared(t, b, "k", "r2")
	ch, stop := w.Watch("k")
	defer stop()
	if _, err := marking(t, b, "k", "w", ttl); !errors.Is(err, sqllock.ErrNotAcquired) {
		t.Fatal(err)
	}
	release(t, b, r1)
	drain(ch)
	release(t, b, r2)
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatal("no signal on the key after its last reader's release")
	}
	if _, err := marking(t, b, "k", "w", ttl); err != nil {
		t.Fatalf("writer after the signal: %v", err)
	}
}
