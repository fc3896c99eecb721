package backendtest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// testPermits checks the semaphore rules of [sqllock.PermitAcquirer], each
// on a backend of its own, when the backend implements it.
func testPermits(t *testing.T, h Harness) {
	if _, ok := h.New(t).(sqllock.PermitAcquirer); !ok {
		t.Skip("backend does not implement sqllock.PermitAcquirer")
	}
	tests := []struct {
		name string
		fn   func(t *testing.T, h Harness, b sqllock.Backend, p sqllock.PermitAcquirer)
	}{
		{"GrantsUpToLimit", testPermitsUpToLimit},
		{"RefusalNamesHoldersAndSoonest", testPermitRefusal},
		{"SameOwnerRetryGetsSameGrant", testPermitSameOwner},
		{"ReleaseFreesAPermit", testPermitRelease},
		{"ExpiryFreesAPermit", testPermitExpiry},
		{"IsAnOrdinaryLease", testPermitOrdinaryLease},
		{"DisagreeingLimitRefused", testPermitLimit},
		{"BadInputRefusedWithoutTrace", testPermitBadInput},
		{"RaceNeverExceedsLimit", testPermitRace},
		{"WatchSignalsRelease", testPermitWatch},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Parallel()
			b := h.New(t)
			tt.fn(t, h, b, b.(sqllock.PermitAcquirer))
		})
	}
}

func permit(t *testing.T, p sqllock.PermitAcquirer, sem string, n int, owner string) sqllock.Lease {
	t.Helper()
	l, err := p.TryAcquirePermit(ctx(t), permitReq(sem, n, owner))
	if err != nil {
		t.Fatalf("TryAcquirePermit(%q, %d, %q): %v", sem, n, owner, err)
	}
	s, i, ok := sqllock.ParsePermitKey(l.Key)
	if !ok || s != sem || i < 1 || i > n || l.Owner != owner || l.Token <= 0 {
		t.Fatalf("TryAcquirePermit(%q, %d, %q) = %+v: not a permit of %q (1..%d) for %q", sem, n, owner, l, sem, n, owner)
	}
	if got := l.Deadline.Sub(l.BackendTime); got < ttl || got > ttl+time.Millisecond {
		t.Errorf("permit's Deadline - BackendTime = %v, want TTL %v", got, ttl)
	}
	return l
}

func permitReq(sem string, n int, owner string) sqllock.PermitRequest {
	return sqllock.PermitRequest{AcquireRequest: sqllock.AcquireRequest{Key: sem, TTL: ttl, Owner: owner}, Permits: n}
}

func permitsHeld(t *testing.T, p sqllock.PermitAcquirer, sem string, n int, owner string) *sqllock.PermitsHeldError {
	t.Helper()
	_, err := p.TryAcquirePermit(ctx(t), permitReq(sem, n, owner))
	var pe *sqllock.PermitsHeldError
	if !errors.Is(err, sqllock.ErrNotAcquired) || !errors.As(err, &pe) {
		t.Fatalf("TryAcquirePermit(%q, %d, %q) = %v, want a *PermitsHeldError matching ErrNotAcquired", sem, n, owner, err)
	}
	return pe
}

func testPermitsUpToLimit(t *testing.T, h Harness, b sqllock.Backend, p sqllock.PermitAcquirer) {
	const n = 3
	keys := map[string]bool{}
	for i := range n {
		l := permit(t, p, "sem", n, fmt.Sprint("o", i))
		if keys[l.Key] {
			t.Fatalf("permit %s granted twice", l.Key)
		}
		keys[l.Key] = true
	}
	permitsHeld(t, p, "sem", n, "late")
	held := 0
	all, err := b.List(ctx(t), "sem")
	if err != nil {
		t.Fatal(err)
	}
	for _, i := range all {
		if _, _, ok := sqllock.ParsePermitKey(i.Key); ok && i.Held {
			held++
		}
	}
	if held != n {
		t.Errorf("List shows %d held permits, want %d: %+v", held, n, all)
	}
	// Semaphores are independent of each other and of single keys.
	permit(t, p, "sem2", 1, "o")
	acquire(t, b, "sem", "single")
}

func testPermitRefusal(t *testing.T, h Harness, b sqllock.Backend, p sqllock.PermitAcquirer) {
	var ls []sqllock.Lease
	for i, d := range []time.Duration{ttl, ttl / 4, ttl / 2} {
		req := permitReq("sem", 3, fmt.Sprint("o", i))
		req.TTL = d
		req.Value = []byte(fmt.Sprint("v", i))
		l, err := p.TryAcquirePermit(ctx(t), req)
		if err != nil {
			t.Fatal(err)
		}
		ls = append(ls, l)
	}
	before, _ := b.List(ctx(t), "sem")
	pe := permitsHeld(t, p, "sem", 3, "late")
	if pe.Key != "sem" || pe.Permits != 3 || len(pe.Holders) != 3 {
		t.Fatalf("refusal = %+v, want key sem, 3 permits, 3 holders", pe)
	}
	for i, hd := range pe.Holders {
		if hd.Key != sqllock.PermitKey("sem", i+1) {
			t.Errorf("holder %d is %q, want the permits in order", i, hd.Key)
		}
	}
	for _, l := range ls {
		found := false
		for _, hd := range pe.Holders {
			if hd.Key == l.Key && hd.Owner == l.Owner && hd.Token == l.Token && string(hd.Value) == "v"+l.Owner[1:] && hd.Remaining > 0 {
				found = true
			}
		}
		if !found {
			t.Errorf("refusal's holders %+v miss %+v", pe.Holders, l)
		}
	}
	if pe.Remaining <= 0 || pe.Remaining > ttl/4 {
		t.Errorf("refusal's soonest end %v, want in (0, %v]: the shortest lease's", pe.Remaining, ttl/4)
	}
	var he *sqllock.HeldError
	if !errors.As(pe, &he) || he.Owner != "o1" || he.Remaining != pe.Remaining {
		t.Errorf("refusal as a HeldError = %+v, want the soonest holder o1", he)
	}
	after, _ := b.List(ctx(t), "sem")
	if fmt.Sprint(strip(before)) != fmt.Sprint(strip(after)) {
		t.Errorf("a refusal changed the semaphore:\n%+v\n%+v", before, after)
	}
}

// strip drops what changes with the clock from a listing.
func strip(in []sqllock.LockInfo) []sqllock.LockInfo {
	out := make([]sqllock.LockInfo, len(in))
	for i, x := range in {
		x.Remaining = 0
		out[i] = x
	}
	return out
}

func testPermitSameOwner(t *testing.T, h Harness, b sqllock.Backend, p sqllock.PermitAcquirer) {
	permit(t, p, "sem", 2, "other")
	l1 := permit(t, p, "sem", 2, "o1")
	l2 := permit(t, p, "sem", 2, "o1")
	if l2.Key != l1.Key || l2.Token != l1.Token {
		t.Fatalf("retry with the same owner got %s token %d, want the same grant %s token %d", l2.Key, l2.Token, l1.Key, l1.Token)
	}
	if l2.Deadline.Before(l1.Deadline) {
		t.Errorf("retry moved the deadline back: %v < %v", l2.Deadline, l1.Deadline)
	}
	// It took no second permit: a release of o1's frees one for a third.
	release(t, b, l2)
	permit(t, p, "sem", 2, "third")
}

func testPermitRelease(t *testing.T, h Harness, b sqllock.Backend, p sqllock.PermitAcquirer) {
	l1 := permit(t, p, "sem", 2, "o1")
	permit(t, p, "sem", 2, "o2")
	release(t, b, l1)
	l3 := permit(t, p, "sem", 2, "o3")
	if l3.Key != l1.Key || l3.Token <= l1.Token {
		t.Errorf("after releasing %s token %d got %s token %d, want that permit with a larger token", l1.Key, l1.Token, l3.Key, l3.Token)
	}
	permitsHeld(t, p, "sem", 2, "o4")
	// Tokens strictly increase per permit, over many tenures.
	last := l3.Token
	for range 5 {
		release(t, b, l3)
		l3 = permit(t, p, "sem", 2, "again")
		if l3.Key != l1.Key || l3.Token <= last {
			t.Fatalf("got %s token %d after token %d of %s, want a larger token of the freed permit", l3.Key, l3.Token, last, l1.Key)
		}
		last = l3.Token
	}
}

func testPermitExpiry(t *testing.T, h Harness, b sqllock.Backend, p sqllock.PermitAcquirer) {
	l1 := permit(t, p, "sem", 2, "o1")
	permit(t, p, "sem", 2, "o2")
	h.Expire(t, b, l1.Key)
	l3 := permit(t, p, "sem", 2, "o3")
	if l3.Key != l1.Key || l3.Token <= l1.Token {
		t.Fatalf("after %s expired got %s token %d, want that permit with a token above %d", l1.Key, l3.Key, l3.Token, l1.Token)
	}
	_, err := b.TryRenew(ctx(t), l1, ttl)
	lost(t, err, "TryRenew of the expired permit", sqllock.LostTaken)
	permitsHeld(t, p, "sem", 2, "o4")
}

func testPermitOrdinaryLease(t *testing.T, h Harness, b sqllock.Backend, p sqllock.PermitAcquirer) {
	l := permit(t, p, "sem", 2, "o1")
	r, err := b.TryRenew(ctx(t), l, 2*ttl)
	if err != nil || r.Token != l.Token || r.Key != l.Key {
		t.Fatalf("TryRenew of a permit = %+v, %v", r, err)
	}
	if br, ok := b.(sqllock.BatchRenewer); ok {
		res, err := br.TryRenewBatch(ctx(t), []sqllock.RenewRequest{{Lease: l, TTL: ttl}})
		if err != nil || len(res) != 1 || res[0].Err != nil {
			t.Fatalf("TryRenewBatch of a permit = %+v, %v", res, err)
		}
	}
	if i, ok := info(t, b, l.Key); !ok || !i.Held || i.Token != l.Token || i.Owner != "o1" {
		t.Errorf("List shows the permit as %+v, want held by o1", i)
	}
	// Released by another owner (a forced release), it is a loss to it.
	forced := l
	forced.Owner = "admin"
	release(t, b, forced)
	_, err = b.TryRenew(ctx(t), l, ttl)
	lost(t, err, "TryRenew after a forced release", sqllock.LostReleased)
	// A single-key acquire never takes a permit or the limit's row.
	for _, k := range []string{l.Key, sqllock.LimitKey("sem")} {
		if _, err := b.TryAcquire(ctx(t), sqllock.AcquireRequest{Key: k, TTL: ttl, Owner: "x"}); !errors.Is(err, sqllock.ErrInvalidKey) {
			t.Errorf("TryAcquire(%q) = %v, want ErrInvalidKey", k, err)
		}
	}
}

func testPermitLimit(t *testing.T, h Harness, b sqllock.Backend, p sqllock.PermitAcquirer) {
	l := permit(t, p, "sem", 3, "o1")
	release(t, b, l) // the limit stays, held or not
	before, _ := b.List(ctx(t), "")
	for _, n := range []int{1, 2, 4, sqllock.MaxPermits} {
		_, err := p.TryAcquirePermit(ctx(t), permitReq("sem", n, "o2"))
		var le *sqllock.PermitLimitError
		if !errors.Is(err, sqllock.ErrPermitLimit) || !errors.As(err, &le) || le.Key != "sem" || le.Asked != n || le.Stored != 3 {
			t.Errorf("TryAcquirePermit with limit %d on a semaphore of 3 = %v, want a *PermitLimitError", n, err)
		}
	}
	after, _ := b.List(ctx(t), "")
	if fmt.Sprint(strip(before)) != fmt.Sprint(strip(after)) {
		t.Errorf("a refused limit changed the table:\n%+v\n%+v", before, after)
	}
	permit(t, p, "sem", 3, "o3")
}

func testPermitBadInput(t *testing.T, h Harness, b sqllock.Backend, p sqllock.PermitAcquirer) {
	permit(t, p, "sem", 2, "o1")
	before, _ := b.List(ctx(t), "")
	long := strings.Repeat("k", sqllock.MaxKeyLen-len(sqllock.PermitKey("", 9)))
	cases := []struct {
		name string
		req  sqllock.PermitRequest
		want error
	}{
		{"ZeroPermits", permitReq("sem", 0, "o"), sqllock.ErrInvalidPermits},
		{"NegativePermits", permitReq("sem", -1, "o"), sqllock.ErrInvalidPermits},
		{"TooManyPermits", permitReq("new", sqllock.MaxPermits+1, "o"), sqllock.ErrInvalidPermits},
		{"KeyIsAPermit", permitReq(sqllock.PermitKey("sem", 1), 2, "o"), sqllock.ErrInvalidKey},
		{"KeyIsALimit", permitReq(sqllock.LimitKey("sem"), 2, "o"), sqllock.ErrInvalidKey},
		{"PermitKeysTooLong", permitReq(long, 10, "o"), sqllock.ErrInvalidKey},
		{"EmptyKey", permitReq("", 2, "o"), sqllock.ErrInvalidKey},
		{"EmptyOwner", permitReq("sem", 2, ""), sqllock.ErrInvalidOwner},
		{"BadTTL", sqllock.PermitRequest{AcquireRequest: sqllock.AcquireRequest{Key: "sem", Owner: "o"}, Permits: 2}, sqllock.ErrInvalidTTL},
		{"MinHold", sqllock.PermitRequest{AcquireRequest: sqllock.AcquireRequest{Key: "sem", TTL: ttl, Owner: "o", MinHold: ttl}, Permits: 2}, sqllock.ErrMinHoldUnsupported},
	}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, c := range cases {
		for _, cx := range []context.Context{ctx(t), cancelled} {
			if _, err := p.TryAcquirePermit(cx, c.req); !errors.Is(err, c.want) {
				t.Errorf("%s: got %v, want %v", c.name, err, c.want)
			}
		}
	}
	// The longest semaphore key whose keys fit is accepted.
	permit(t, p, long, 9, "o")
	after, _ := b.List(ctx(t), "")
	var kept []sqllock.LockInfo
	for _, i := range after {
		if !strings.HasPrefix(i.Key, long) {
			kept = append(kept, i)
		}
	}
	if fmt.Sprint(strip(before)) != fmt.Sprint(strip(kept)) {
		t.Errorf("bad input left a trace:\n%+v\n%+v", before, kept)
	}
}

// testPermitRace has goroutines take and give back permits at once. Each
// counts itself in from the moment its grant returned until just before
// it releases: an interval inside its tenure at the backend, so a count
// above the limit means the backend had more holders than permits.
func testPermitRace(t *testing.T, h Harness, b sqllock.Backend, p sqllock.PermitAcquirer) {
	const n, workers, rounds = 3, 8, 6
	var in, peak, grants atomic.Int64
	var mu sync.Mutex
	tokens := map[string]int64{} // per permit, the last token seen
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for r := range rounds {
				l, err := p.TryAcquirePermit(ctx(t), permitReq("race", n, fmt.Sprintf("w%d-%d", w, r)))
				if errors.Is(err, sqllock.ErrNotAcquired) {
					time.Sleep(time.Millisecond)
					continue
				}
				if err != nil {
					t.Error(err)
					return
				}
				grants.Add(1)
				c := in.Add(1)
				for {
					p := peak.Load()
					if c <= p || peak.CompareAndSwap(p, c) {
						break
					}
				}
				mu.Lock()
				if l.Token <= tokens[l.Key] {
					t.Errorf("%s: token %d after %d", l.Key, l.Token, tokens[l.Key])
				}
				tokens[l.Key] = l.Token
				mu.Unlock()
				time.Sleep(time.Millisecond)
				in.Add(-1)
				if err := b.Release(ctx(t), l); err != nil {
					t.Error(err)
				}
			}
		})
	}
	wg.Wait()
	if peak.Load() > n {
		t.Errorf("%d permits held at once, limit %d", peak.Load(), n)
	}
	if grants.Load() < n {
		t.Errorf("only %d grants in %d attempts", grants.Load(), workers*rounds)
	}
	// Contenders that never release: exactly n of them win.
	var won atomic.Int64
	for w := range workers {
		wg.Go(func() {
			if _, err := p.TryAcquirePermit(ctx(t), permitReq("race", n, fmt.Sprint("keep", w))); err == nil {
				won.Add(1)
			} else if !errors.Is(err, sqllock.ErrNotAcquired) {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	if won.Load() > n {
		t.Errorf("%d contenders hold a permit, limit %d", won.Load(), n)
	}
}

func testPermitWatch(t *testing.T, h Harness, b sqllock.Backend, p sqllock.PermitAcquirer) {
	w, ok := b.(sqllock.Watcher)
	if !ok {
		t.Skip("backend does not implement sqllock.Watcher")
	}
	ch, stop := w.Watch("sem")
	defer stop()
	for i := range 2 {
		l1 := permit(t, p, "sem", 2, fmt.Sprint("a", i))
		l2 := permit(t, p, "sem", 2, fmt.Sprint("b", i))
		permitsHeld(t, p, "sem", 2, "waiter")
		drain(ch)
		release(t, b, []sqllock.Lease{l1, l2}[i])
		select {
		case <-ch:
		case <-time.After(10 * time.Second):
			t.Fatalf("no wake-up of the semaphore's watch within 10s of releasing permit %s", []sqllock.Lease{l1, l2}[i].Key)
		}
		release(t, b, []sqllock.Lease{l1, l2}[1-i])
	}
}
