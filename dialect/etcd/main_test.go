package etcd

import (
	"context"
	"encoding/json"
	"os"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/dialect/etcd/internal/etcdtest"
	"github.com/ashlock/ashlock/internal/testkit/etcdserver"
	"github.com/ashlock/ashlock/internal/testkit/leakcheck"
)

func TestMain(m *testing.M) {
	code := etcdtest.Main(m)
	// Every client is closed and every watch stopped by t.Cleanup: no
	// goroutine of the backend or of the etcd client may be left.
	os.Exit(leakcheck.Check(code))
}

// testBundle is one test's client of the shared etcd and a Backend under a
// prefix of its own.
type testBundle struct {
	cli     *clientv3.Client
	backend *Backend
}

func newBundle(t testing.TB) *testBundle {
	t.Helper()
	cli := etcdtest.Client(t)
	b, err := New(cli, Options{Prefix: etcdtest.Prefix(t, cli)})
	require.NoError(t, err)
	return &testBundle{cli: cli, backend: b}
}

// startCluster starts an etcd cluster of opts from the machine's binary
// for one test (skipped without one, or failed with SQLLOCK_REQUIRE_ETCD=1),
// logs its members' output if the test fails, and stops it when the test
// ends.
func startCluster(t *testing.T, opts etcdserver.Options) *etcdserver.Cluster {
	t.Helper()
	if _, err := etcdserver.FindBinary(); err != nil {
		etcdtest.Unavailable(t, err.Error())
	}
	cluster, err := etcdserver.Start(testCtx(t), opts)
	require.NoError(t, err)
	t.Cleanup(func() {
		if t.Failed() {
			t.Log(cluster.Logs())
		}
		cluster.Close()
	})
	return cluster
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// expire ends key's etcd leases now, as etcd's expiry would: the holder
// key and the min-hold key go, the token record stays; and a released
// grant's lease ends too: its release record no longer names the etcd
// lease and TTL (which other Backends may reuse as a spare), so a reap
// takes the lease as ended at its release.
func expire(t testing.TB, b *Backend, key string) {
	t.Helper()
	for _, k := range []string{b.holderKey(key), b.holdKey(key)} {
		resp, err := b.cli.Get(testCtx(t), k)
		require.NoError(t, err)
		if len(resp.Kvs) == 0 {
			continue
		}
		_, err = b.cli.Revoke(testCtx(t), clientv3.LeaseID(resp.Kvs[0].Lease))
		require.NoError(t, err)
	}
	resp, err := b.cli.Get(testCtx(t), b.releaseKey(key))
	require.NoError(t, err)
	if len(resp.Kvs) == 0 {
		return
	}
	var rel releaseRecord
	require.NoError(t, json.Unmarshal(resp.Kvs[0].Value, &rel))
	if rel.Lease != 0 || rel.TTL != 0 {
		v, err := json.Marshal(releaseRecord{Token: rel.Token, By: rel.By})
		require.NoError(t, err)
		_, err = b.cli.Txn(testCtx(t)).If(clientv3.Compare(clientv3.ModRevision(b.releaseKey(key)), "=", resp.Kvs[0].ModRevision)).
			Then(clientv3.OpPut(b.releaseKey(key), string(v))).Commit()
		require.NoError(t, err)
	}
}

// setToken makes key exist, released, at token.
func setToken(t testing.TB, b *Backend, key string, token int64) {
	t.Helper()
	rec, err := json.Marshal(tokenRecord{Token: token, Owner: "settoken"})
	require.NoError(t, err)
	rel, err := json.Marshal(releaseRecord{Token: token, By: "settoken"})
	require.NoError(t, err)
	_, err = b.cli.Txn(testCtx(t)).Then(
		clientv3.OpPut(b.tokenKey(key), string(rec)),
		clientv3.OpDelete(b.holderKey(key)),
		clientv3.OpDelete(b.holdKey(key)),
		clientv3.OpPut(b.releaseKey(key), string(rel)),
	).Commit()
	require.NoError(t, err)
}

// dropSpare forgets etcd lease id if b keeps it as a spare (a test is
// about to revoke it).
func (b *Backend) dropSpare(id clientv3.LeaseID) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for ttl, list := range b.spares {
		b.spares[ttl] = slices.DeleteFunc(list, func(sp spare) bool { return sp.id == id })
	}
}
