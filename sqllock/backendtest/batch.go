package backendtest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// The rules of the batch form of renewal ([sqllock.BatchRenewer]). A
// backend that does not implement it skips them.

func batcher(t *testing.T, b sqllock.Backend) sqllock.BatchRenewer {
	t.Helper()
	br, ok := b.(sqllock.BatchRenewer)
	if !ok {
		t.Skip("backend does not implement sqllock.BatchRenewer")
	}
	return br
}

func renewBatch(t *testing.T, br sqllock.BatchRenewer, reqs ...sqllock.RenewRequest) []sqllock.RenewResult {
	t.Helper()
	res, err := br.TryRenewBatch(ctx(t), reqs)
	if err != nil {
		t.Fatalf("TryRenewBatch(%d leases): %v", len(reqs), err)
	}
	if len(res) != len(reqs) {
		t.Fatalf("TryRenewBatch(%d leases) returned %d results", len(reqs), len(res))
	}
	return res
}

func deadlineOf(t *testing.T, b sqllock.Backend, key string) time.Time {
	t.Helper()
	i, ok := info(t, b, key)
	if !ok {
		t.Fatalf("List: no key %q", key)
	}
	return i.Deadline
}

// One batch with every outcome: each element is judged alone, and a lost
// lease drags none of the others down nor is revived.
func testBatchMixedOutcomes(t *testing.T, h Harness) {
	b := h.New(t)
	br := batcher(t, b)
	live := acquire(t, b, "live", "o1")
	live2 := acquire(t, b, "live2", "o1")
	expired := acquire(t, b, "expired", "o1")
	h.Expire(t, b, "expired")
	released := acquire(t, b, "released", "o1")
	release(t, b, released)
	taken := acquire(t, b, "taken", "o1")
	h.Expire(t, b, "taken")
	newer := acquire(t, b, "taken", "o2")
	newerDeadline := deadlineOf(t, b, "taken")
	never := sqllock.Lease{Key: "never", Token: 7, Owner: "o1"}

	res := renewBatch(t, br,
		sqllock.RenewRequest{Lease: live, TTL: 2 * ttl},
		sqllock.RenewRequest{Lease: expired, TTL: 2 * ttl},
		sqllock.RenewRequest{Lease: released, TTL: 2 * ttl},
		sqllock.RenewRequest{Lease: taken, TTL: 2 * ttl},
		sqllock.RenewRequest{Lease: never, TTL: 2 * ttl},
		sqllock.RenewRequest{Lease: live2, TTL: 3 * ttl},
	)
	for i, l := range []sqllock.Lease{live, live2} {
		r := res[[]int{0, 5}[i]]
		want := []time.Duration{2 * ttl, 3 * ttl}[i]
		if r.Err != nil {
			t.Fatalf("%s: %v, want renewed", l.Key, r.Err)
		}
		if r.Lease.Key != l.Key || r.Lease.Token != l.Token {
			t.Errorf("%s: renewed lease %+v, want key %q token %d", l.Key, r.Lease, l.Key, l.Token)
		}
		if got := r.Lease.Deadline.Sub(r.Lease.BackendTime); got < want || got > want+time.Millisecond {
			t.Errorf("%s: Deadline - BackendTime = %v, want %v", l.Key, got, want)
		}
		if he := held(t, b, l.Key, "o9"); he.Remaining <= ttl {
			t.Errorf("%s: after a batch renewal to %v the holder has %v left", l.Key, want, he.Remaining)
		}
	}
	if !res[0].Lease.BackendTime.Equal(res[5].Lease.BackendTime) {
		t.Errorf("one batch, two backend times: %v and %v", res[0].Lease.BackendTime, res[5].Lease.BackendTime)
	}
	lost(t, res[1].Err, "expired element", sqllock.LostExpired)
	lost(t, res[2].Err, "released element", sqllock.LostReleased)
	le := lost(t, res[3].Err, "taken element", sqllock.LostTaken)
	if le.Current != 0 && le.Current != newer.Token {
		t.Errorf("taken element: Current = %d, want 0 (unknown) or %d", le.Current, newer.Token)
	}
	lost(t, res[4].Err, "never granted element", sqllock.LostReleased)
	for i, r := range res {
		var le *sqllock.LostError
		if errors.As(r.Err, &le) && (le.Key != []sqllock.Lease{live, expired, released, taken, never, live2}[i].Key) {
			t.Errorf("element %d: LostError names key %q", i, le.Key)
		}
	}
	// Nothing lost was revived, and the newer holder was not touched.
	next := acquire(t, b, "expired", "o2")
	if next.Token <= expired.Token {
		t.Errorf("expired key: next token %d, want > %d", next.Token, expired.Token)
	}
	if i, _ := info(t, b, "released"); i.Held {
		t.Errorf("a batch renewal revived a released lease: %+v", i)
	}
	if d := deadlineOf(t, b, "taken"); !d.Equal(newerDeadline) {
		t.Errorf("a stale element moved the newer holder's deadline: %v -> %v", newerDeadline, d)
	}
	if he := held(t, b, "taken", "o3"); he.Owner != "o2" || he.Token != newer.Token {
		t.Errorf("taken key: holder %+v, want o2 token %d", he, newer.Token)
	}
}

// A lease given twice is renewed once, by the longer TTL, and both
// elements report it; the same key with an old and the current token is
// two leases.
func testBatchKeyTwice(t *testing.T, h Harness) {
	b := h.New(t)
	br := batcher(t, b)
	l := acquire(t, b, "k", "o1")
	res := renewBatch(t, br,
		sqllock.RenewRequest{Lease: l, TTL: 3 * ttl},
		sqllock.RenewRequest{Lease: l, TTL: ttl},
	)
	for i, r := range res {
		if r.Err != nil {
			t.Fatalf("element %d: %v, want renewed", i, r.Err)
		}
		if got := r.Lease.Deadline.Sub(r.Lease.BackendTime); got < 3*ttl || got > 3*ttl+time.Millisecond {
			t.Errorf("element %d: Deadline - BackendTime = %v, want the longer TTL %v", i, got, 3*ttl)
		}
	}
	if !res[0].Lease.Deadline.Equal(res[1].Lease.Deadline) {
		t.Errorf("one lease, two deadlines: %v and %v", res[0].Lease.Deadline, res[1].Lease.Deadline)
	}
	if d := deadlineOf(t, b, "k"); !d.Equal(res[0].Lease.Deadline) {
		t.Errorf("List deadline %v, reported %v", d, res[0].Lease.Deadline)
	}

	h.Expire(t, b, "k")
	l2 := acquire(t, b, "k", "o2")
	for _, order := range [][2]sqllock.Lease{{l, l2}, {l2, l}} {
		res = renewBatch(t, br,
			sqllock.RenewRequest{Lease: order[0], TTL: 2 * ttl},
			sqllock.RenewRequest{Lease: order[1], TTL: 2 * ttl},
		)
		for i, r := range res {
			if order[i].Token == l2.Token {
				if r.Err != nil || r.Lease.Token != l2.Token {
					t.Errorf("current lease beside a stale one of its key: %+v, %v", r.Lease, r.Err)
				}
				continue
			}
			lost(t, r.Err, "stale lease beside the current one of its key", sqllock.LostTaken)
		}
	}
	if he := held(t, b, "k", "o3"); he.Owner != "o2" || he.Token != l2.Token {
		t.Errorf("holder %+v, want o2 token %d", he, l2.Token)
	}
}

// An empty batch returns no results and does no I/O.
func testBatchEmpty(t *testing.T, h Harness) {
	b := h.New(t)
	br := batcher(t, b)
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, c := range []context.Context{ctx(t), cancelled} {
		for _, reqs := range [][]sqllock.RenewRequest{nil, {}} {
			res, err := br.TryRenewBatch(c, reqs)
			if err != nil || len(res) != 0 {
				t.Errorf("TryRenewBatch(%#v) = %v, %v; want no results, nil", reqs, res, err)
			}
		}
	}
}

// One bad element refuses the whole batch before any I/O, with the error
// the single form gives for it: no element is renewed.
func testBatchBadElement(t *testing.T, h Harness) {
	b := h.New(t)
	br := batcher(t, b)
	l := acquire(t, b, "k", "o1")
	before := deadlineOf(t, b, "k")
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	bad := []struct {
		name string
		req  sqllock.RenewRequest
		want error
	}{
		{"EmptyKey", sqllock.RenewRequest{Lease: sqllock.Lease{Token: 1, Owner: "o"}, TTL: ttl}, sqllock.ErrInvalidKey},
		{"KeyNUL", sqllock.RenewRequest{Lease: sqllock.Lease{Key: "k\x00", Token: 1, Owner: "o"}, TTL: ttl}, sqllock.ErrInvalidKey},
		{"KeyInvalidUTF8", sqllock.RenewRequest{Lease: sqllock.Lease{Key: "\xff", Token: 1, Owner: "o"}, TTL: ttl}, sqllock.ErrInvalidKey},
		{"TokenZero", sqllock.RenewRequest{Lease: sqllock.Lease{Key: "k", Owner: "o"}, TTL: ttl}, sqllock.ErrInvalidToken},
		{"TTLZero", sqllock.RenewRequest{Lease: l}, sqllock.ErrInvalidTTL},
		{"TTLAboveMax", sqllock.RenewRequest{Lease: l, TTL: sqllock.MaxTTL + 1}, sqllock.ErrInvalidTTL},
		{"OwnerNUL", sqllock.RenewRequest{Lease: sqllock.Lease{Key: "k", Token: 1, Owner: "o\x00"}, TTL: ttl}, sqllock.ErrInvalidOwner},
	}
	for _, bb := range bad {
		for pos := range 3 {
			reqs := []sqllock.RenewRequest{{Lease: l, TTL: 2 * ttl}, {Lease: l, TTL: 2 * ttl}}
			reqs = append(reqs[:pos], append([]sqllock.RenewRequest{bb.req}, reqs[pos:]...)...)
			for _, c := range []context.Context{ctx(t), cancelled} {
				res, err := br.TryRenewBatch(c, reqs)
				if !errors.Is(err, bb.want) || res != nil {
					t.Errorf("%s at %d: got %v, %v; want %v and no results", bb.name, pos, res, err, bb.want)
				}
				if !errors.Is(err, bb.want) || !containsIndex(err, pos) {
					t.Errorf("%s at %d: error %q does not name the element", bb.name, pos, err)
				}
			}
		}
	}
	if d := deadlineOf(t, b, "k"); !d.Equal(before) {
		t.Errorf("a refused batch renewed its good element: deadline %v -> %v", before, d)
	}
}

func containsIndex(err error, i int) bool {
	return err != nil && strings.Contains(err.Error(), fmt.Sprintf("renewal %d of", i))
}

// Many leases in one batch, the way a client holding thousands renews
// them: every one renewed, at one backend time.
func testBatchMany(t *testing.T, h Harness) {
	b := h.New(t)
	br := batcher(t, b)
	const n = 500
	reqs := make([]sqllock.RenewRequest, n)
	for i := range reqs {
		// An hour, not ttl: the first lease must still be held when the
		// batch is sent, however long 500 acquires take under -race on a
		// loaded machine (with ttl, 10s, it had expired after 14 to 20s
		// behind PgBouncer and on etcd).
		key := fmt.Sprintf("many-%03d", i)
		l, err := b.TryAcquire(ctx(t), sqllock.AcquireRequest{Key: key, TTL: time.Hour, Owner: "o1"})
		if err != nil || l.Key != key || l.Token <= 0 {
			t.Fatalf("TryAcquire(%q) = %+v, %v", key, l, err)
		}
		reqs[i] = sqllock.RenewRequest{Lease: l, TTL: 2 * ttl}
	}
	res := renewBatch(t, br, reqs...)
	for i, r := range res {
		if r.Err != nil || r.Lease.Key != reqs[i].Lease.Key || r.Lease.Token != reqs[i].Lease.Token {
			t.Fatalf("element %d (%s): %+v, %v; want renewed", i, reqs[i].Lease.Key, r.Lease, r.Err)
		}
		if !r.Lease.BackendTime.Equal(res[0].Lease.BackendTime) {
			t.Fatalf("element %d: backend time %v, element 0: %v", i, r.Lease.BackendTime, res[0].Lease.BackendTime)
		}
	}
}
