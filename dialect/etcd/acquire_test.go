package etcd

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/sqllock"
)

// spareFor acquires and releases key with ttl on b, and returns the etcd
// lease the release left as a spare (kept alive before: not fresh).
func spareFor(t *testing.T, b *Backend, key string, ttl time.Duration) clientv3.LeaseID {
	t.Helper()
	ctx := testCtx(t)
	l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: ttl, Owner: "o"})
	require.NoError(t, err)
	id := holderLease(t, b, key)
	require.NoError(t, b.Release(ctx, l))
	return id
}

// TestAcquireTakesWarmSpares: the first acquire of a TTL grants its etcd
// lease, and a background grant of spares follows. An acquire takes a
// spare with its keep-alive sent together with the transaction, its lease
// dated from the keep-alive's send time (after the acquire was sent, as
// the Client's local deadline assumes), and no lease grant on its path;
// but never a spare granted within freshFor (etcd 3.4 may answer a
// keep-alive just after a grant with TTL 0: etcd-io/etcd#13675): with
// only those at hand, it grants a lease of its own.
func TestAcquireTakesWarmSpares(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	b.warmTo = 4
	ctx := testCtx(t)
	acquire := func(key string) {
		t.Helper()
		before := time.Now()
		l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: 9 * time.Second, Owner: "o"})
		require.NoError(t, err)
		require.False(t, l.BackendTime.Before(before), "%s: lease dated %v, before the acquire was sent at %v", key, l.BackendTime, before)
		require.Equal(t, 9*time.Second, l.Deadline.Sub(l.BackendTime))
		b.warmWG.Wait()
	}
	acquire("first")
	_, by := calls.Take()
	require.Equal(t, "LeaseGrant×5 Txn×1", by, "the first acquire's grant, then 4 spares granted ahead")
	acquire("young")
	_, by = calls.Take()
	require.Equal(t, "LeaseGrant×1 Txn×1", by, "the spares were granted just now: a grant of its own")
	time.Sleep(freshFor)
	acquire("warm")
	_, by = calls.Take()
	require.Equal(t, "LeaseGrant×1 LeaseKeepAlive×1 Txn×1", by, "a spare's keep-alive with the transaction (the grant tops the spares up, in the background)")
}

// TestAcquireDatesFromKeepAliveSend: an acquire on a spare dates its
// deadline from its keep-alive's send time, not from the reply: with a
// keep-alive sent 200 ms late, the lease began before it was sent.
func TestAcquireDatesFromKeepAliveSend(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	spare := spareFor(t, b, "first", 9*time.Second)
	var mu sync.Mutex
	var sending time.Time
	calls.SetKeepAlive(func(id int64) int64 {
		if id == int64(spare) {
			mu.Lock()
			sending = time.Now()
			mu.Unlock()
			time.Sleep(200 * time.Millisecond)
		}
		return 0
	})
	l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: 9 * time.Second, Owner: "o"})
	require.NoError(t, err)
	require.Equal(t, spare, holderLease(t, b, "k"), "the acquire took the spare")
	mu.Lock()
	defer mu.Unlock()
	require.False(t, sending.IsZero(), "a keep-alive was sent on the spare")
	require.True(t, l.BackendTime.Before(sending), "BackendTime %v, keep-alive sent at %v", l.BackendTime, sending)
	require.Equal(t, 9*time.Second, l.Deadline.Sub(l.BackendTime))
}

// requireSentAgain checks the outcome of an acquire (sent at before)
// whose first attempt put its holder on a spare etcd lease etcd let go,
// or whose renewal was not known: granted, token token, dated after it
// was sent, and held on an etcd lease that is none of spares.
func requireSentAgain(t *testing.T, b *Backend, l sqllock.Lease, err error, before time.Time, token int64, spares ...clientv3.LeaseID) {
	t.Helper()
	require.NoError(t, err)
	require.Equal(t, token, l.Token)
	require.False(t, l.BackendTime.Before(before), "lease dated %v, before the acquire was sent at %v", l.BackendTime, before)
	got := holderLease(t, b, l.Key)
	require.NotZero(t, got, "no holder")
	require.NotContains(t, spares, got, "held on the spare")
}

// TestAcquireSpareGoneUnderIt: a spare that etcd lets go after the
// acquire's transaction put the holder key on it (its keep-alive, sent
// with the transaction, finds it gone) is no grant: the acquire is sent
// again on an etcd lease granted for it, and granted there, dated after
// it was sent, the key's next token. The same for a permit and for a set
// of keys.
func TestAcquireSpareGoneUnderIt(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		holder  string // the key the grant's holder goes on
		acquire func(ctx context.Context, b *Backend) (sqllock.Lease, error)
	}{
		{"key", "k", func(ctx context.Context, b *Backend) (sqllock.Lease, error) {
			return b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: 9 * time.Second, Owner: "o"})
		}},
		{"permit", sqllock.PermitKey("sem", 1), func(ctx context.Context, b *Backend) (sqllock.Lease, error) {
			return b.TryAcquirePermit(ctx, sqllock.PermitRequest{AcquireRequest: sqllock.AcquireRequest{Key: "sem", TTL: 9 * time.Second, Owner: "o"}, Permits: 1})
		}},
		{"set", "k", func(ctx context.Context, b *Backend) (sqllock.Lease, error) {
			ls, err := b.TryAcquireAll(ctx, sqllock.MultiAcquireRequest{Keys: []string{"k"}, TTL: 9 * time.Second, Owner: "o"})
			if err != nil {
				return sqllock.Lease{}, err
			}
			return ls[0], nil
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			b, calls, _ := counted(t)
			ctx := testCtx(t)
			// Two spares, each let go under the acquire that takes it: the
			// second attempt must not take the other one.
			spares := map[int64]bool{}
			var ls []sqllock.Lease
			for _, key := range []string{"first", "second"} {
				l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: 9 * time.Second, Owner: "o"})
				require.NoError(t, err)
				spares[int64(holderLease(t, b, key))] = true
				ls = append(ls, l)
			}
			for _, l := range ls {
				require.NoError(t, b.Release(ctx, l))
			}
			require.Len(t, spares, 2)
			var keptAlive atomic.Int32 // keep-alives sent on the spares
			calls.SetKeepAlive(func(id int64) int64 {
				if !spares[id] {
					return 0
				}
				keptAlive.Add(1)
				// Wait for the transaction to put the holder on the
				// spare, then end the lease, as its expiry would.
				for range 200 {
					if holderLease(t, b, tc.holder) == clientv3.LeaseID(id) {
						break
					}
					time.Sleep(5 * time.Millisecond)
				}
				_, err := b.cli.Revoke(ctx, clientv3.LeaseID(id))
				require.NoError(t, err)
				return 0
			})
			before := time.Now()
			l, err := tc.acquire(ctx, b)
			calls.SetKeepAlive(nil)
			require.Equal(t, int32(1), keptAlive.Load(), "keep-alives on the spares")
			var ids []clientv3.LeaseID
			for id := range spares {
				ids = append(ids, clientv3.LeaseID(id))
			}
			requireSentAgain(t, b, l, err, before, 2, ids...) // token 1 went with the spare
			require.Equal(t, tc.holder, l.Key)
			require.Equal(t, 9*time.Second, l.Deadline.Sub(l.BackendTime))
		})
	}
}

// TestAcquireKeepAliveFailed: an acquire whose transaction put the
// holder key on a spare and whose keep-alive failed (the stream broke) is
// no grant on the spare: its period began before the acquire was sent,
// which the Client's local deadline does not allow for. The acquire is
// sent again, the owner's repeat, which finds the key still held and
// grants it again with its token, moved onto an etcd lease of its own.
func TestAcquireKeepAliveFailed(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	spare := spareFor(t, b, "first", 9*time.Second)
	var keptAlive atomic.Bool // the acquire sent the spare's keep-alive
	calls.SetKeepAlive(func(id int64) int64 {
		if id != int64(spare) {
			return 0
		}
		keptAlive.Store(true)
		for range 200 {
			if holderLease(t, b, "k") == spare {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		b.ka.mu.Lock()
		s := b.ka.cur
		b.ka.mu.Unlock()
		s.cancel() // the stream breaks under the keep-alive
		return 0
	})
	req := sqllock.AcquireRequest{Key: "k", TTL: 9 * time.Second, Owner: "o"}
	before := time.Now()
	l, err := b.TryAcquire(ctx, req)
	calls.SetKeepAlive(nil)
	// The premise first: an acquire that did not take the spare (a lease
	// of its own, no keep-alive) says nothing about a failed keep-alive.
	require.True(t, keptAlive.Load(), "the acquire did not take spare %x (holder lease %x, err %v)", spare, holderLease(t, b, "k"), err)
	requireSentAgain(t, b, l, err, before, 1, spare) // the repeat's grant again, on a lease of its own
}

// TestAcquireLateKeepAliveNotTrusted plays an etcd with bug
// etcd-io/etcd#20547 on an acquire: the spare's keep-alive reaches etcd
// after the spare expired (the transaction sent with it put the holder
// key on it just before), and is answered with a positive TTL after the
// lease's keys were deleted. A reply that comes after the spare's TTL
// could have ended is not trusted: the acquire never reports a grant
// whose holder key is gone; it is sent again on an etcd lease of its own
// and granted there, the key's next token. About 2 s: a real etcd expiry
// of etcd's shortest lease.
func TestAcquireLateKeepAliveNotTrusted(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	// The reply is held back past the spare's expiry, more than the
	// stream watchdog's 2 s of silence: the watchdog would fail the
	// stream first, a path of its own (TestAcquireKeepAliveFailed), and
	// the late reply would never be seen.
	b.ka.stall = time.Minute
	ctx := testCtx(t)
	spare := spareFor(t, b, "first", 2*time.Second)
	b.mu.Lock()
	granted := b.granted[2]
	b.mu.Unlock()
	calls.SetKeepAlive(func(id int64) int64 {
		if id != int64(spare) {
			return 0
		}
		for range 200 {
			if holderLease(t, b, "k") == spare {
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		// Until etcd expired the spare, and its keys went.
		for range 400 {
			if holderLease(t, b, "k") == 0 {
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
		return granted
	})
	before := time.Now()
	l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: 2 * time.Second, Owner: "o"})
	calls.SetKeepAlive(nil)
	requireSentAgain(t, b, l, err, before, 2, spare) // token 1 went with the spare
}
