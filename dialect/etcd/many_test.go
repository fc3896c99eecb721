package etcd

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/dialect/etcd/internal/etcdtest"
	"github.com/ashlock/ashlock/sqllock"
)

// singleRenewals counts the leases the Client renews alone (TryRenew)
// rather than in a batch.
type singleRenewals struct {
	*Backend
	n atomic.Int64
}

func (s *singleRenewals) TryRenew(ctx context.Context, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
	s.n.Add(1)
	return s.Backend.TryRenew(ctx, l, ttl)
}

// TestManyLeasesRenewedInBatches: one Client holds many leases through
// etcd (1,000; 10,000 with SQLLOCK_LONG=1) for three renewal periods. None
// is lost, none is renewed alone, all of them on one keep-alive stream,
// and the round trips of the renewals are counted: one keep-alive per
// lease (each lease is its own etcd lease, so that it expires alone) and
// one read-only transaction per MaxTxnOps leases. That is O(n) keep-alive
// messages, pipelined on the one stream, and O(n / MaxTxnOps)
// transactions per period; never a transaction per lease. The 10,000 hold
// a 15 s TTL: with 6 s (5,000 keep-alives a second) at a load of 15 on two
// cores, a keep-alive waited on past its caller's deadline once ended the
// stream for every request on it, and the acquires then in flight were
// refused as unavailable. A late caller now sheds the stream and its
// requests still waited for are sent again (see kaStream), but the TTL
// stays: the test is about counting round trips.
func TestManyLeasesRenewedInBatches(t *testing.T) {
	t.Parallel()
	n, ttl := 1000, 6*time.Second // renewed every 2 s
	if os.Getenv("SQLLOCK_LONG") == "1" {
		n, ttl = 10000, 15*time.Second
	}
	calls := &etcdtest.Calls{}
	cli, err := etcdtest.NewClient(etcdtest.Endpoints(t), calls.DialOptions()...)
	require.NoError(t, err)
	t.Cleanup(func() { cli.Close() })
	be, err := New(cli, Options{Prefix: etcdtest.Prefix(t, cli)})
	require.NoError(t, err)
	counted := &singleRenewals{Backend: be}
	c, err := sqllock.New(counted, sqllock.Options{Owner: "many", TTL: ttl})
	require.NoError(t, err)
	defer c.Close(context.Background())
	ctx := testCtx(t)

	guards := make([]*sqllock.Guard, n)
	var next atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	for range 16 {
		wg.Go(func() {
			for i := int(next.Add(1)) - 1; i < n; i = int(next.Add(1)) - 1 {
				g, err := c.TryAcquire(ctx, fmt.Sprintf("many-%05d", i), nil)
				if err != nil {
					t.Errorf("acquire %d: %v", i, err)
					return
				}
				guards[i] = g
			}
		})
	}
	wg.Wait()
	require.False(t, t.Failed())
	acquired := time.Since(start)

	calls.Take()
	const periods = 3
	hold := periods*ttl/3 + ttl/6 // each lease renewed three times
	time.Sleep(hold)
	total, by := calls.Take()
	counts := map[string]int{}
	for _, method := range []string{"LeaseKeepAlive", "Txn", "Range", "LeaseGrant"} {
		counts[method] = countOf(by, method)
	}

	lost := 0
	for _, g := range guards {
		if g.Context().Err() != nil {
			lost++
		}
	}
	renewals := float64(counts["LeaseKeepAlive"]) / float64(n)
	t.Logf("%d leases acquired in %v; held %v: %d round trips (%s): %.2f keep-alives per lease (about %d renewals each), %d transactions (%.1f per period); %d lost, %d renewed alone, %d keep-alive streams",
		n, acquired.Round(time.Millisecond), hold, total, by, renewals, periods, counts["Txn"], float64(counts["Txn"])/periods, lost, counted.n.Load(), calls.KeepAliveStreams())
	require.Zero(t, lost, "leases lost while held")
	require.Zero(t, counted.n.Load(), "leases renewed alone, not in a batch")
	require.Equal(t, 1, calls.KeepAliveStreams(), "keep-alive streams opened")
	// Each lease was renewed periods times, give or take one (a lease
	// acquired late in the acquire phase, or renewed at the hold's end).
	require.InDelta(t, periods, renewals, 1.01, "keep-alives per lease over the hold")
	// A transaction per MaxTxnOps leases per renewal, with room for the
	// scheduler's batches that are not full (a batch per ~100 ms slot
	// the leases fell into); far below one per lease.
	perPeriod := float64(counts["Txn"]) / renewals
	maxPerPeriod := float64(n)/float64(DefaultMaxTxnOps) + 32
	require.LessOrEqual(t, perPeriod, maxPerPeriod, "transactions per renewal period")

	for _, g := range guards {
		require.NoError(t, g.Release(ctx))
	}
}

// countOf is method's count in a [etcdtest.Calls.Take] list ("A×3 B×1").
func countOf(by, method string) int {
	var n int
	for _, part := range strings.Fields(by) {
		m, count, ok := strings.Cut(part, "×")
		if k, err := strconv.Atoi(count); ok && err == nil && m == method {
			n += k
		}
	}
	return n
}
