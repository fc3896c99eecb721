package etcd

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"

	"github.com/ashlock/ashlock/dialect/etcd/internal/etcdtest"
	"github.com/ashlock/ashlock/internal/testkit/etcdserver"
	"github.com/ashlock/ashlock/sqllock"
)

// TestKeepAliveStreamOnTheLeader: on three members, each Backend opens its
// keep-alive stream on the leader's endpoint, whichever member its client
// would have put it on (a follower answers a stream's keep-alives one at
// a time, each forwarded to the leader: see keepAlives.leaderConn); a
// stream opened when no leader was found looks for it again after a
// while; and after the leader moves, the stream follows it once a reply
// shows the new raft term. Keep-alives are counted by each member's own
// metrics.
// Six Backends, each with a client of all three endpoints: were streams
// placed by the client, all six would land on the leader one time in 729.
func TestKeepAliveStreamOnTheLeader(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	cluster := startCluster(t, etcdserver.Options{Members: 3})
	require.NoError(t, cluster.WaitReady(ctx))
	eps := cluster.Endpoints()
	leader, err := cluster.Leader(ctx)
	require.NoError(t, err)

	type holder struct {
		b *Backend
		l sqllock.Lease
	}
	const seek = 300 * time.Millisecond
	var holders []holder
	for i := range 6 {
		cli, err := etcdtest.NewClient(eps)
		require.NoError(t, err)
		t.Cleanup(func() { cli.Close() })
		b, err := New(cli, Options{Prefix: "leader/"})
		require.NoError(t, err)
		// The first stream is opened as if no member answered as the
		// leader (a cluster electing): on the client's connection, until
		// its first reply after seek.
		searched := false
		b.ka.seek = seek
		b.ka.findLeader = func() (*grpc.ClientConn, uint64) {
			if !searched {
				searched = true
				return nil, 0
			}
			return b.ka.leaderConn()
		}
		l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: fmt.Sprintf("k%d", i), TTL: 10 * time.Second, Owner: "o"})
		require.NoError(t, err)
		holders = append(holders, holder{b, l})
	}
	renewAll := func(times int) {
		t.Helper()
		for range times {
			for i, h := range holders {
				l, err := h.b.TryRenew(ctx, h.l, 10*time.Second)
				require.NoError(t, err, "renew k%d", i)
				holders[i].l = l
			}
		}
	}
	requireOn := func(member int, what string) {
		t.Helper()
		before := keepAlivesBy(t, eps)
		renewAll(3)
		after := keepAlivesBy(t, eps)
		for i := range eps {
			got := after[i] - before[i]
			if i == member {
				require.GreaterOrEqual(t, got, 3*len(holders), "%s: keep-alives on member %d (the leader)", what, i)
			} else {
				require.Zero(t, got, "%s: keep-alives on member %d, a follower (the leader is %d)", what, i, member)
			}
		}
	}
	renewAll(1) // opens each Backend's first stream, without the leader
	time.Sleep(seek)
	renewAll(1) // the first streams' replies after seek: shed, opened again
	requireOn(leader, "before the move")

	// Move the leadership to another member.
	to := (leader + 1) % len(eps)
	lcli, err := etcdtest.NewClient([]string{eps[leader]})
	require.NoError(t, err)
	t.Cleanup(func() { lcli.Close() })
	ids := map[string]uint64{}
	ml, err := lcli.MemberList(ctx)
	require.NoError(t, err)
	for _, m := range ml.Members {
		for _, u := range m.ClientURLs {
			ids[u] = m.ID
		}
	}
	_, err = lcli.MoveLeader(ctx, ids[eps[to]])
	require.NoError(t, err)
	require.Eventually(t, func() bool {
		l, err := cluster.Leader(ctx)
		return err == nil && l == to
	}, 10*time.Second, 50*time.Millisecond, "the leader did not move")
	renewAll(1) // replies of the new term: each stream is shed, and opened again
	requireOn(to, "after the move")
	for _, h := range holders {
		require.NoError(t, h.b.Release(ctx, h.l))
	}
}

// keepAlivesBy returns, for each endpoint, the lease keep-alive requests
// its member has received, by its /metrics.
func keepAlivesBy(t testing.TB, eps []string) []int {
	t.Helper()
	out := make([]int, len(eps))
	for i, ep := range eps {
		series, err := etcdserver.Metrics(testCtx(t), nil, ep)
		require.NoError(t, err)
		for name, v := range series {
			if etcdserver.MetricName(name) == "grpc_server_msg_received_total" && strings.Contains(name, `grpc_method="LeaseKeepAlive"`) {
				out[i] += int(v)
			}
		}
	}
	return out
}
