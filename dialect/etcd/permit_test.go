package etcd

import (
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

func permitReq(sem string, n int, owner string) sqllock.PermitRequest {
	return sqllock.PermitRequest{AcquireRequest: sqllock.AcquireRequest{Key: sem, TTL: 10 * time.Second, Owner: owner}, Permits: n}
}

// heldPermits is the permits of sem that List shows held, by key.
func heldPermits(t *testing.T, b *Backend, sem string) map[string]sqllock.LockInfo {
	t.Helper()
	all, err := b.List(testCtx(t), sem)
	require.NoError(t, err)
	held := map[string]sqllock.LockInfo{}
	for _, i := range all {
		if s, _, ok := sqllock.ParsePermitKey(i.Key); ok && s == sem && i.Held {
			held[i.Key] = i
		}
	}
	return held
}

// TestPermitRoundTrips counts a permit acquire's calls: one transaction
// (and the etcd lease it puts the holder on), also when another Backend
// took the permit this one saw free (the chain passes to the next
// candidate inside the same transaction); a refusal writes nothing and
// asks each holder's time-to-live; the limit is written by the first
// grant, in the same transaction.
func TestPermitRoundTrips(t *testing.T) {
	t.Parallel()
	b, calls, other := counted(t)
	ctx := testCtx(t)
	acquire := func(owner, want string) sqllock.Lease {
		t.Helper()
		calls.Take()
		l, err := b.TryAcquirePermit(ctx, permitReq("sem", 3, owner))
		require.NoError(t, err)
		_, by := calls.Take()
		require.Equal(t, want, by, "calls of %s's permit acquire", owner)
		return l
	}
	l1 := acquire("o1", "LeaseGrant×1 Txn×1") // creates the semaphore
	require.Equal(t, sqllock.PermitKey("sem", 1), l1.Key)
	require.Equal(t, int64(1), l1.Token)
	all, err := b.List(ctx, "sem")
	require.NoError(t, err)
	require.Len(t, all, 2)
	require.Equal(t, sqllock.LimitKey("sem"), all[1].Key)
	require.Equal(t, int64(3), all[1].Token, "the limit's record: token N, never held")
	require.False(t, all[1].Held)

	// Another Backend takes permit 2, which b last saw free.
	l2, err := other.TryAcquirePermit(ctx, permitReq("sem", 3, "x"))
	require.NoError(t, err)
	require.Equal(t, sqllock.PermitKey("sem", 2), l2.Key)
	l3 := acquire("o3", "LeaseGrant×1 Txn×1")
	require.Equal(t, sqllock.PermitKey("sem", 3), l3.Key, "the chain passed over the permit taken elsewhere")

	calls.Take()
	_, err = b.TryAcquirePermit(ctx, permitReq("sem", 3, "late"))
	var pe *sqllock.PermitsHeldError
	require.True(t, errors.As(err, &pe), "%v", err)
	_, by := calls.Take()
	require.Equal(t, "LeaseGrant×1 LeaseTimeToLive×3 Txn×1", by, "a refusal: the transaction, and each holder's time-to-live")
	require.Len(t, pe.Holders, 3)
	require.Equal(t, "x", pe.Holders[1].Owner)

	calls.Take()
	require.NoError(t, b.Release(ctx, l1))
	_, by = calls.Take()
	require.Equal(t, "Txn×1", by)
	time.Sleep(freshFor) // the refusal's lease is a spare now, granted just now
	l4 := acquire("o4", "LeaseKeepAlive×1 Txn×1")
	require.Equal(t, l1.Key, l4.Key)
	require.Equal(t, l1.Token+1, l4.Token, "the freed permit's next token")
}

// TestPermitRetryAfterLostReply: a permit acquire whose reply was lost is
// indeterminate; its repeat, by the same owner, gets the permit it was
// granted (same key, same token), not a second one.
func TestPermitRetryAfterLostReply(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	_, err := b.TryAcquirePermit(ctx, permitReq("sem", 3, "x"))
	require.NoError(t, err)
	loseReply(b, calls, "Txn", 1, nil)
	_, err = b.TryAcquirePermit(ctx, permitReq("sem", 3, "o1"))
	require.ErrorIs(t, err, sqllock.ErrIndeterminate)
	calls.SetFail(nil)
	held := heldPermits(t, b, "sem")
	require.Len(t, held, 2, "the lost reply's grant was applied")
	l, err := b.TryAcquirePermit(ctx, permitReq("sem", 3, "o1"))
	require.NoError(t, err)
	require.Equal(t, "o1", held[l.Key].Owner, "the repeat got the permit the first attempt was granted")
	require.Equal(t, held[l.Key].Token, l.Token, "same token: one tenure")
	require.Len(t, heldPermits(t, b, "sem"), 2, "the repeat took no second permit")
	_, err = b.TryAcquirePermit(ctx, permitReq("sem", 3, "o2"))
	require.NoError(t, err, "the third permit is still free")
}

// TestPermitChainWithinMaxTxnOps: a semaphore of more permits than one
// transaction's chain takes (etcd counts each nested level against
// --max-txn-ops: 100 levels are more than the test etcd's default of 128
// allows) grants every permit, each once, and refuses the next with every
// holder.
func TestPermitChainWithinMaxTxnOps(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		maxOps, n int
	}{{0, 100}, {9, 8}} {
		t.Run(fmt.Sprintf("MaxTxnOps%d", c.maxOps), func(t *testing.T) {
			t.Parallel()
			bb := newBundle(t)
			b, err := New(bb.cli, Options{Prefix: bb.backend.Prefix(), MaxTxnOps: c.maxOps})
			require.NoError(t, err)
			b.permitSpare = 1 << 20 // every chain as long as one transaction takes
			ctx := testCtx(t)
			got := map[string]bool{}
			for i := range c.n {
				l, err := b.TryAcquirePermit(ctx, permitReq("big", c.n, fmt.Sprint("o", i)))
				require.NoError(t, err, "permit %d of %d", i+1, c.n)
				require.False(t, got[l.Key], "%s granted twice", l.Key)
				got[l.Key] = true
			}
			_, err = b.TryAcquirePermit(ctx, permitReq("big", c.n, "late"))
			var pe *sqllock.PermitsHeldError
			require.True(t, errors.As(err, &pe), "%v", err)
			require.Len(t, pe.Holders, c.n)
		})
	}
}

// TestPermitTokensAcrossBackends: Backends of their own take and release
// the permits of one semaphore in turns, each with hints the others made
// stale: every permit's token strictly increases, exactly by one.
func TestPermitTokensAcrossBackends(t *testing.T) {
	t.Parallel()
	first := newBundle(t).backend
	ctx := testCtx(t)
	bs := []*Backend{first}
	for range 2 {
		b, err := New(first.cli, Options{Prefix: first.Prefix()})
		require.NoError(t, err)
		bs = append(bs, b)
	}
	last := map[string]int64{}
	for r := range 12 {
		b := bs[r%len(bs)]
		l, err := b.TryAcquirePermit(ctx, permitReq("sem", 2, fmt.Sprint("o", r)))
		require.NoError(t, err, "round %d", r)
		require.Equal(t, last[l.Key]+1, l.Token, "round %d: %s", r, l.Key)
		last[l.Key] = l.Token
		if r%3 != 2 {
			require.NoError(t, b.Release(ctx, l))
		} else {
			expire(t, b, l.Key)
		}
	}
	require.Len(t, last, 2)
}

// TestClientSettlesIndeterminatePermit: through sqllock.Client, a permit
// acquire whose reply is lost is settled by the client's repeat into one
// Guard on the permit granted: one permit taken, one tenure.
func TestClientSettlesIndeterminatePermit(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	c, err := sqllock.New(b, sqllock.Options{})
	require.NoError(t, err)
	defer c.Close(ctx)
	// The Backend knows the semaphore: its next acquire is the chain alone,
	// with no read of the limit that would show the lost grant.
	g, err := c.AcquirePermit(ctx, "sem", 2, &sqllock.AcquireOptions{TTL: 10 * time.Second})
	require.NoError(t, err)
	require.NoError(t, g.Release(ctx))
	loseReply(b, calls, "Txn", 1, nil)
	g, err = c.AcquirePermit(ctx, "sem", 2, &sqllock.AcquireOptions{TTL: 10 * time.Second})
	require.NoError(t, err)
	require.Equal(t, sqllock.PermitKey("sem", 1), g.Key())
	require.Equal(t, int64(2), g.Token())
	held := heldPermits(t, b, "sem")
	require.Len(t, held, 1, "the repeat took no second permit")
	require.Equal(t, g.Token(), held[g.Key()].Token)
	require.NoError(t, g.Release(ctx))
	require.Empty(t, heldPermits(t, b, "sem"))
}

// TestPermitsAcrossBackendsNeverExceedLimit: goroutines on Backends of
// their own (processes, as far as etcd can tell), each with hints the
// others make stale, take and release permits of one semaphore: never more
// than N counted in at once (each counts itself in from its grant's return
// to just before its release: inside its tenure at etcd), every permit's
// token strictly increasing, and no permit left held at the end.
func TestPermitsAcrossBackendsNeverExceedLimit(t *testing.T) {
	t.Parallel()
	first := newBundle(t).backend
	ctx := testCtx(t)
	const n, backends, workers, rounds = 3, 3, 3, 12
	var in, peak, grants, unavailable atomic.Int64
	var mu sync.Mutex
	tokens := map[string]int64{}
	var wg sync.WaitGroup
	for bi := range backends {
		b, err := New(first.cli, Options{Prefix: first.Prefix()})
		require.NoError(t, err)
		for w := range workers {
			wg.Go(func() {
				for r := range rounds {
					l, err := b.TryAcquirePermit(ctx, permitReq("sem", n, fmt.Sprintf("b%d-w%d-%d", bi, w, r)))
					if errors.Is(err, sqllock.ErrUnavailable) {
						unavailable.Add(1) // the semaphore changed under every attempt
						continue
					}
					if errors.Is(err, sqllock.ErrNotAcquired) {
						continue
					}
					if err != nil {
						t.Error(err)
						return
					}
					grants.Add(1)
					c := in.Add(1)
					for p := peak.Load(); c > p && !peak.CompareAndSwap(p, c); p = peak.Load() {
					}
					mu.Lock()
					if l.Token <= tokens[l.Key] {
						t.Errorf("%s: token %d after %d", l.Key, l.Token, tokens[l.Key])
					}
					tokens[l.Key] = l.Token
					mu.Unlock()
					time.Sleep(time.Millisecond)
					in.Add(-1)
					if err := b.Release(ctx, l); err != nil {
						t.Error(err)
					}
				}
			})
		}
	}
	wg.Wait()
	require.LessOrEqual(t, peak.Load(), int64(n), "permits held at once")
	require.Positive(t, grants.Load())
	require.Empty(t, heldPermits(t, first, "sem"))
	t.Logf("%d grants of %d attempts (%d unavailable), peak %d of %d", grants.Load(), backends*workers*rounds, unavailable.Load(), peak.Load(), n)
}
