package backendtest

import (
	"errors"
	"testing"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// minHold is long enough that no test outlives it.
const minHold = time.Hour

func acquireMinHold(t *testing.T, b sqllock.Backend, key, owner string, hold time.Duration) sqllock.Lease {
	t.Helper()
	l, err := b.TryAcquire(ctx(t), sqllock.AcquireRequest{Key: key, TTL: ttl, Owner: owner, MinHold: hold})
	if err != nil {
		t.Fatalf("TryAcquire(%q, %q, MinHold %v): %v", key, owner, hold, err)
	}
	return l
}

// checkHeldUntil checks that key is held by owner with token until about
// grant + minHold by the backend's clock: List says so and another owner's
// acquire is refused, naming the holder.
func checkHeldUntil(t *testing.T, b sqllock.Backend, l sqllock.Lease, owner, what string) {
	t.Helper()
	until := l.BackendTime.Add(minHold)
	i, _ := info(t, b, l.Key)
	if !i.Held || i.Token != l.Token || i.Owner != owner {
		t.Errorf("%s: List = %+v, want held by %q with token %d", what, i, owner, l.Token)
	}
	// At least grant + MinHold; no later than that plus what a backend may
	// round a duration up by (etcd: whole seconds).
	if i.Deadline.Before(until) || i.Deadline.After(until.Add(2*time.Second)) {
		t.Errorf("%s: deadline %v, want grant %v + MinHold %v = %v", what, i.Deadline, l.BackendTime, minHold, until)
	}
	he := held(t, b, l.Key, "other")
	if he.Owner != owner || he.Token != l.Token {
		t.Errorf("%s: refused acquire's HeldError = %+v, want holder %q token %d", what, he, owner, l.Token)
	}
	if he.Remaining <= ttl {
		t.Errorf("%s: HeldError.Remaining = %v, want about MinHold %v", what, he.Remaining, minHold)
	}
}

// A release before grant + MinHold succeeds and leaves the key held by
// its owner, with its token, until then by the backend's clock; the next
// grant (after that time, here forced with Expire) is the next token.
func testMinHoldReleaseKeepsHeld(t *testing.T, h Harness) {
	b := h.New(t)
	l := acquireMinHold(t, b, "k", "o1", minHold)
	if l.Deadline.Before(l.BackendTime.Add(minHold)) {
		t.Errorf("grant deadline %v, want at least grant %v + MinHold", l.Deadline, l.BackendTime)
	}
	release(t, b, l)
	checkHeldUntil(t, b, l, "o1", "after a release inside the min hold")
	release(t, b, l) // a repeat is harmless and changes nothing
	checkHeldUntil(t, b, l, "o1", "after a second release")
	lost(t, ignoreLease(b.TryRenew(ctx(t), l, ttl)), "TryRenew after release", sqllock.LostReleased)
	h.Expire(t, b, "k")
	next := acquire(t, b, "k", "o2")
	if next.Token != l.Token+1 {
		t.Errorf("next grant token %d, want %d", next.Token, l.Token+1)
	}
}

// A holder that never releases (a crash) keeps the key until the later of
// its own deadline and grant + MinHold; renewals never move the deadline
// before grant + MinHold.
func testMinHoldCrashKeepsLater(t *testing.T, h Harness) {
	b := h.New(t)
	l := acquireMinHold(t, b, "k", "o1", minHold)
	checkHeldUntil(t, b, l, "o1", "held, never released")
	r, err := b.TryRenew(ctx(t), l, ttl)
	if err != nil {
		t.Fatalf("TryRenew: %v", err)
	}
	if r.Deadline.Before(l.BackendTime.Add(minHold)) {
		t.Errorf("renewal deadline %v moved before grant %v + MinHold", r.Deadline, l.BackendTime)
	}
	checkHeldUntil(t, b, l, "o1", "held after a renewal")
	if br, ok := b.(sqllock.BatchRenewer); ok {
		res, err := br.TryRenewBatch(ctx(t), []sqllock.RenewRequest{{Lease: l, TTL: ttl}})
		if err != nil || res[0].Err != nil {
			t.Fatalf("TryRenewBatch: %v %v", err, res)
		}
		if d := res[0].Lease.Deadline; d.Before(l.BackendTime.Add(minHold)) {
			t.Errorf("batch renewal deadline %v moved before grant %v + MinHold", d, l.BackendTime)
		}
		checkHeldUntil(t, b, l, "o1", "held after a batch renewal")
	}
}

// A new tenure of the same owner (its lease expired, its acquire sent
// again) gets its own min hold, not the previous tenure's (none here):
// the key stays held after its release until its own grant + MinHold.
func testMinHoldNewTenureSameOwner(t *testing.T, h Harness) {
	b := h.New(t)
	first := acquire(t, b, "k", "o1")
	h.Expire(t, b, "k")
	l := acquireMinHold(t, b, "k", "o1", minHold)
	if l.Token != first.Token+1 {
		t.Fatalf("new tenure token %d, want %d", l.Token, first.Token+1)
	}
	release(t, b, l)
	checkHeldUntil(t, b, l, "o1", "after the release of a new tenure of the same owner inside its min hold")
}

// A release after grant + MinHold releases at once.
func testMinHoldPassedReleasesAtOnce(t *testing.T, h Harness) {
	b := h.New(t)
	const short = 30 * time.Millisecond
	l := acquireMinHold(t, b, "k", "o1", short)
	// The grant was applied before its reply: 3×short after the reply is
	// past grant + short by the backend's clock too (plus what the
	// backend rounds a hold up by).
	time.Sleep(3*short + h.MinHoldRoundUp)
	release(t, b, l)
	if i, _ := info(t, b, "k"); i.Held {
		t.Errorf("List after a release past the min hold = %+v, want not held", i)
	}
	next := acquire(t, b, "k", "o2")
	if next.Token != l.Token+1 {
		t.Errorf("next grant token %d, want %d", next.Token, l.Token+1)
	}
}

// A forced release (another owner's) ends a min hold at once, as it ends
// any lease; a release without MinHold is unchanged by the feature.
func testMinHoldForcedRelease(t *testing.T, h Harness) {
	b := h.New(t)
	l := acquireMinHold(t, b, "k", "o1", minHold)
	release(t, b, sqllock.Lease{Key: l.Key, Token: l.Token, Owner: "operator"})
	if i, _ := info(t, b, "k"); i.Held {
		t.Errorf("List after a forced release = %+v, want not held", i)
	}
	next := acquire(t, b, "k", "o2")
	if next.Token != l.Token+1 {
		t.Errorf("next grant token %d, want %d", next.Token, l.Token+1)
	}
	// The next grant carries no min hold of its own: released at once.
	release(t, b, next)
	if i, _ := info(t, b, "k"); i.Held {
		t.Errorf("a lease without MinHold after one with it: List after release = %+v, want not held", i)
	}
	_, err := b.TryAcquire(ctx(t), sqllock.AcquireRequest{Key: "k", TTL: ttl, Owner: "o3", MinHold: -time.Second})
	if !errors.Is(err, sqllock.ErrInvalidTTL) {
		t.Errorf("TryAcquire with a negative MinHold = %v, want ErrInvalidTTL", err)
	}
}

// testMinHoldRefused: a backend without min holds refuses one before any
// I/O, so it is never silently dropped.
func testMinHoldRefused(t *testing.T, h Harness) {
	b := h.New(t)
	_, err := b.TryAcquire(ctx(t), sqllock.AcquireRequest{Key: "k", TTL: ttl, Owner: "o1", MinHold: minHold})
	if !errors.Is(err, sqllock.ErrMinHoldUnsupported) {
		t.Fatalf("TryAcquire with MinHold = %v, want ErrMinHoldUnsupported", err)
	}
	if _, found := info(t, b, "k"); found {
		t.Errorf("a refused TryAcquire left the key in List")
	}
}
