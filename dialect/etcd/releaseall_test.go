package etcd

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// TestReleaseAllOneTxn: a set's release is one transaction (one round
// trip), and within a lower Options.MaxTxnOps as many as its nested
// transactions need (two operations each); every lease is released.
func TestReleaseAllOneTxn(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	free := func(keys []string) {
		t.Helper()
		for _, k := range keys {
			infos, err := b.List(ctx, k)
			require.NoError(t, err)
			require.True(t, len(infos) == 1 && !infos[0].Held, "%s still held: %+v", k, infos)
		}
	}
	keys := setKeys("k", 4)
	ls, err := b.TryAcquireAll(ctx, setReq("o", keys...))
	require.NoError(t, err)
	calls.Take()
	answers, err := b.ReleaseAll(ctx, ls)
	require.NoError(t, err)
	require.Equal(t, []error{nil, nil, nil, nil}, answers)
	total, by := calls.Take()
	require.Equal(t, 1, total, "a set of 4 released in %s", by)
	free(keys)

	small, err := New(b.cli, Options{Prefix: b.Prefix(), MaxTxnOps: 5}) // three nested releases a transaction
	require.NoError(t, err)
	keys = setKeys("s", 5)
	ls = make([]sqllock.Lease, len(keys))
	for i, k := range keys {
		ls[i], err = small.TryAcquire(ctx, sqllock.AcquireRequest{Key: k, TTL: 10 * time.Second, Owner: "o"})
		require.NoError(t, err)
	}
	calls.Take()
	answers, err = small.ReleaseAll(ctx, ls)
	require.NoError(t, err)
	require.Equal(t, []error{nil, nil, nil, nil, nil}, answers)
	total, by = calls.Take()
	require.Equal(t, 2, total, "5 leases within MaxTxnOps 5 released in %s", by)
	free(keys)
}
