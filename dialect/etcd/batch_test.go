package etcd

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/dialect/etcd/internal/etcdtest"
	"github.com/ashlock/ashlock/sqllock"
)

// TestBatchSplitsUnderMaxTxnOps: a batch renewal puts at most MaxTxnOps
// operations in a transaction, counting a nested transaction's own as
// etcd does (a parent of n nested ones of width w needs n + w); the
// keep-alives all go on the one stream. With MaxTxnOps 8, 12 leases are
// checked in 3 transactions of at most 5; 24 leases renewed to a longer
// TTL than granted are moved onto new etcd leases the same way.
func TestBatchSplitsUnderMaxTxnOps(t *testing.T) {
	t.Parallel()
	calls := &etcdtest.Calls{}
	cli, err := etcdtest.NewClient(etcdtest.Endpoints(t), calls.DialOptions()...)
	require.NoError(t, err)
	t.Cleanup(func() { cli.Close() })
	_, err = New(cli, Options{MaxTxnOps: 3})
	require.Error(t, err, "MaxTxnOps below what a grant needs")
	b, err := New(cli, Options{Prefix: etcdtest.Prefix(t, cli), MaxTxnOps: 8})
	require.NoError(t, err)
	ctx := testCtx(t)
	batch := func(n int, ttl time.Duration) []sqllock.RenewRequest {
		var reqs []sqllock.RenewRequest
		for i := range n {
			l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: fmt.Sprintf("k%d-%d", n, i), TTL: 3 * time.Second, Owner: "o"})
			require.NoError(t, err)
			reqs = append(reqs, sqllock.RenewRequest{Lease: l, TTL: ttl})
		}
		return reqs
	}
	for _, c := range []struct {
		n    int
		ttl  time.Duration
		want string
	}{
		{12, 3 * time.Second, "LeaseKeepAlive×12 Txn×3"},
		{24, 5 * time.Second, "LeaseGrant×24 LeaseKeepAlive×24 Txn×10"}, // 5 checks, 5 moves
	} {
		reqs := batch(c.n, c.ttl)
		calls.Take()
		res, err := b.TryRenewBatch(ctx, reqs)
		require.NoError(t, err)
		_, by := calls.Take()
		require.Equal(t, c.want, by, "%d leases", c.n)
		for i, r := range res {
			require.NoError(t, r.Err, "element %d", i)
			require.Equal(t, c.ttl, r.Lease.Deadline.Sub(r.Lease.BackendTime))
			require.Equal(t, res[0].Lease.BackendTime, r.Lease.BackendTime, "one batch, one backend time")
		}
	}
}
