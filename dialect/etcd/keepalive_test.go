package etcd

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// TestKeepAlivesShareOneStream: the keep-alives of a Backend's renewals
// and spare reuses go on one lease keep-alive stream, opened once, and
// each reply reaches the request of its own lease: concurrent renewals of
// leases with different TTLs each report their own lease's TTL.
func TestKeepAlivesShareOneStream(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	const n = 24
	ttl := func(i int) time.Duration { return time.Duration(3+i%6) * time.Second }
	leases := make([]sqllock.Lease, n)
	for i := range n {
		l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: fmt.Sprintf("k%d", i), TTL: ttl(i), Owner: "o"})
		require.NoError(t, err)
		leases[i] = l
	}
	calls.Take()
	for round := range 3 {
		var wg sync.WaitGroup
		for i := range n {
			wg.Go(func() {
				r, err := b.TryRenew(ctx, leases[i], ttl(i))
				if err != nil {
					t.Errorf("round %d: renew %d: %v", round, i, err)
					return
				}
				if got := r.Deadline.Sub(r.BackendTime); got != ttl(i) {
					t.Errorf("round %d: lease %d (TTL %v) reported %v: another lease's reply", round, i, ttl(i), got)
				}
			})
		}
		wg.Wait()
	}
	total, by := calls.Take()
	require.Equal(t, 2*3*n, total, by) // a keep-alive and a check per renewal
	// A released lease's etcd lease is reused by the next acquire of its
	// TTL, with a keep-alive on the same stream.
	require.NoError(t, b.Release(ctx, leases[0]))
	_, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "again", TTL: ttl(0), Owner: "o"})
	require.NoError(t, err)
	_, by = calls.Take()
	require.Contains(t, by, "LeaseKeepAlive×1", "the acquire reused the spare")
	require.Equal(t, 1, calls.KeepAliveStreams(), "keep-alive streams opened")
}

// TestKeepAliveAbandonedKeepsTheStream: a keep-alive whose caller gave
// up before its reply leaves the stream in use (on etcd: the unit tests
// with a fake stream cover the rest of the rule), and its late reply is
// not taken for the next request of its lease: the abandoned request's
// reply is made to carry a TTL of 3 s, the next one gets etcd's 5.
func TestKeepAliveAbandonedKeepsTheStream(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: 5 * time.Second, Owner: "o"})
	require.NoError(t, err)
	_, err = b.TryRenew(ctx, l, 5*time.Second)
	require.NoError(t, err)
	require.Equal(t, 1, calls.KeepAliveStreams())
	id := holderLease(t, b, "k")
	gone, cancel := context.WithCancel(ctx)
	var once sync.Once
	calls.SetKeepAlive(func(int64) int64 {
		ttl := int64(0)
		once.Do(func() {
			cancel() // ended as it is sent, before its reply can come back
			ttl = 3
		})
		return ttl
	})
	_, err = b.ka.once(gone, id)
	require.ErrorIs(t, err, context.Canceled)
	calls.SetKeepAlive(nil)
	ttl, err := b.ka.once(ctx, id)
	require.NoError(t, err)
	require.Equal(t, int64(5), ttl, "the abandoned request's reply")
	r, err := b.TryRenew(ctx, l, 5*time.Second)
	require.NoError(t, err)
	require.Equal(t, 5*time.Second, r.Deadline.Sub(r.BackendTime))
	require.Equal(t, 1, calls.KeepAliveStreams(), "keep-alive streams opened: an abandoned keep-alive ended the stream")
}
