package etcd

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/sqllock"
)

func TestFenced(t *testing.T) {
	t.Parallel()
	b := newBundle(t).backend
	ctx := testCtx(t)
	data := b.Prefix() + "data"
	acquire := func(owner string) sqllock.Lease {
		l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: 10 * time.Second, Owner: owner})
		require.NoError(t, err)
		return l
	}
	value := func() string {
		resp, err := b.cli.Get(ctx, data)
		require.NoError(t, err)
		if len(resp.Kvs) == 0 {
			return ""
		}
		return string(resp.Kvs[0].Value)
	}
	lost := func(err error, want sqllock.LostReason) {
		t.Helper()
		var le *sqllock.LostError
		require.ErrorAs(t, err, &le)
		require.Equal(t, want, le.Reason, "%v", err)
	}

	l1 := acquire("o1")
	resp, err := b.Fenced(ctx, l1, clientv3.OpPut(data, "1"), clientv3.OpGet(data))
	require.NoError(t, err)
	require.Len(t, resp.Responses, 2)
	require.Equal(t, "1", string(resp.Responses[1].GetResponseRange().Kvs[0].Value))
	// The caller's own compares, in a nested transaction.
	resp, err = b.Fenced(ctx, l1, clientv3.OpTxn(
		[]clientv3.Cmp{clientv3.Compare(clientv3.Value(data), "=", "0")},
		[]clientv3.Op{clientv3.OpPut(data, "never")}, nil))
	require.NoError(t, err)
	require.False(t, resp.Responses[0].GetResponseTxn().Succeeded)
	require.Equal(t, "1", value())

	expire(t, b, "k")
	_, err = b.Fenced(ctx, l1, clientv3.OpPut(data, "expired"))
	lost(err, sqllock.LostExpired)
	l2 := acquire("o2")
	_, err = b.Fenced(ctx, l1, clientv3.OpPut(data, "stale"))
	lost(err, sqllock.LostTaken)
	require.Equal(t, "1", value(), "no write of a lost lease is applied")
	_, err = b.Fenced(ctx, l2, clientv3.OpPut(data, "2"))
	require.NoError(t, err)
	require.NoError(t, b.Release(ctx, l2))
	_, err = b.Fenced(ctx, l2, clientv3.OpPut(data, "released"))
	lost(err, sqllock.LostReleased)
	require.Equal(t, "2", value())
}

func TestFencedIndeterminate(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: 10 * time.Second, Owner: "o"})
	require.NoError(t, err)
	loseReply(b, calls, "Txn", 1, nil)
	_, err = b.Fenced(ctx, l, clientv3.OpPut(b.Prefix()+"data", "x"))
	require.ErrorIs(t, err, sqllock.ErrIndeterminate)
}
