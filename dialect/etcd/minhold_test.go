package etcd

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/sqllock"
)

// revokeOf ends the etcd lease that etcd key k is on, as etcd's expiry
// of that lease would.
func revokeOf(t *testing.T, b *Backend, k string) {
	t.Helper()
	resp, err := b.cli.Get(testCtx(t), k)
	require.NoError(t, err)
	require.Len(t, resp.Kvs, 1, "%s", k)
	_, err = b.cli.Revoke(testCtx(t), clientv3.LeaseID(resp.Kvs[0].Lease))
	require.NoError(t, err)
}

// heldBy checks that key is taken by owner with token: List says so and
// another owner's acquire is refused, naming the holder.
func heldBy(t *testing.T, b *Backend, key, owner string, token int64) {
	t.Helper()
	infos, err := b.List(testCtx(t), key)
	require.NoError(t, err)
	require.Len(t, infos, 1)
	require.True(t, infos[0].Held, "List: %+v", infos[0])
	require.Equal(t, owner, infos[0].Owner)
	require.Equal(t, token, infos[0].Token)
	_, err = b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: "other"})
	var he *sqllock.HeldError
	require.True(t, errors.As(err, &he), "another owner's acquire: %v", err)
	require.Equal(t, owner, he.Owner)
	require.Equal(t, token, he.Token)
}

// A holder that crashes inside its min hold: its own etcd lease ends (as
// etcd's expiry ends it) and the key stays taken by it, with its token,
// until the min hold's etcd lease ends too; then the next grant is the
// next token. The Backend asked is a fresh one, which knows nothing of
// the grant but what etcd holds.
func TestMinHoldOutlivesTheHoldersLease(t *testing.T) {
	t.Parallel()
	b := newBundle(t).backend
	ctx := testCtx(t)
	l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: 10 * time.Second, Owner: "o1", MinHold: time.Hour})
	require.NoError(t, err)
	revokeOf(t, b, b.holderKey("k"))
	fresh, err := New(b.cli, Options{Prefix: b.Prefix()})
	require.NoError(t, err)
	heldBy(t, fresh, "k", "o1", l.Token)
	infos, err := fresh.List(ctx, "k")
	require.NoError(t, err)
	require.Greater(t, infos[0].Remaining, 50*time.Minute, "the min hold's end, from etcd's time-to-live")
	revokeOf(t, b, b.holdKey("k"))
	next, err := fresh.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: 10 * time.Second, Owner: "o2"})
	require.NoError(t, err)
	require.Equal(t, l.Token+1, next.Token)
}

// A min hold shorter than the lease: when the hold's etcd lease ends
// first, the holder keeps its lease (renewals, the refusal of others),
// and its release frees the key at once.
func TestMinHoldEndsBeforeTheLease(t *testing.T) {
	t.Parallel()
	b := newBundle(t).backend
	ctx := testCtx(t)
	l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Hour, Owner: "o1", MinHold: 10 * time.Second})
	require.NoError(t, err)
	revokeOf(t, b, b.holdKey("k"))
	_, err = b.TryRenew(ctx, l, time.Hour)
	require.NoError(t, err)
	heldBy(t, b, "k", "o1", l.Token)
	require.NoError(t, b.Release(ctx, l))
	next, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Hour, Owner: "o2"})
	require.NoError(t, err, "a release after the min hold frees the key at once")
	require.Equal(t, l.Token+1, next.Token)
}

// The operator's forced release of a key its owner released inside its
// min hold ends the hold at once; the owner's repeat is then a loss it
// is told of, not a second release.
func TestMinHoldForcedAfterOwnersRelease(t *testing.T) {
	t.Parallel()
	b := newBundle(t).backend
	ctx := testCtx(t)
	l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o1", MinHold: time.Hour})
	require.NoError(t, err)
	require.NoError(t, b.Release(ctx, l))
	heldBy(t, b, "k", "o1", l.Token)
	forced := l
	forced.Owner = "operator"
	err = b.Release(ctx, forced)
	require.ErrorIs(t, err, sqllock.ErrLeaseLost, "the operator is told the lease was released already")
	require.NoError(t, b.Release(ctx, forced), "a repeat by the operator is nil")
	next, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o2"})
	require.NoError(t, err, "the forced release ended the min hold")
	require.Equal(t, l.Token+1, next.Token)
}

// TestReleaseOfAnUnseenMinHold: a release by a Backend that did not
// grant the lease (so knows nothing of its min hold) finds the min-hold
// key that the flat release requires absent, and releases with the hold's
// rules all the same: the owner's release leaves the key taken by the
// hold, and a release by another owner ends it.
func TestReleaseOfAnUnseenMinHold(t *testing.T) {
	t.Parallel()
	b := newBundle(t).backend
	ctx := testCtx(t)
	for _, forced := range []bool{false, true} {
		key := map[bool]string{false: "own", true: "forced"}[forced]
		l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: 10 * time.Second, Owner: "o1", MinHold: time.Hour})
		require.NoError(t, err)
		fresh, err := New(b.cli, Options{Prefix: b.Prefix()})
		require.NoError(t, err)
		rel := l
		if forced {
			rel.Owner = "admin"
		}
		require.NoError(t, fresh.Release(ctx, rel), key)
		require.NoError(t, fresh.Release(ctx, rel), "%s: a repeat", key)
		require.Zero(t, holderLease(t, b, key), "%s: the holder key is gone", key)
		resp, err := b.cli.Get(ctx, b.holdKey(key))
		require.NoError(t, err)
		if forced {
			require.Empty(t, resp.Kvs, "a forced release ends the min hold")
			_, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: "next"})
			require.NoError(t, err)
		} else {
			require.Len(t, resp.Kvs, 1, "the owner's release leaves the min hold")
			heldBy(t, fresh, key, "o1", l.Token)
		}
	}
}
