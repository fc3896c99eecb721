package etcd

import (
	"encoding/json"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/sqllock"
)

// sameEtcd is a second Backend on tb's etcd and prefix: another process.
func sameEtcd(t *testing.T, tb *testBundle) *Backend {
	t.Helper()
	b, err := New(tb.cli, Options{Prefix: tb.backend.prefix})
	require.NoError(t, err)
	return b
}

func reqFor(key, owner string) sqllock.AcquireRequest {
	return sqllock.AcquireRequest{Key: key, TTL: 10 * time.Second, Owner: owner}
}

// TestReapBetweenFirstGrantReadAndTxn lets a reap land between a first
// grant's reads (no token record, the floor as this Backend knows it) and
// its transaction: meanwhile another Backend creates the key, takes it to
// token 5 and reaps it, so the key has no token record again when the
// grant's transaction runs. The grant compares the floor unchanged, fails,
// and takes token 6; a grant that did not compare it would take token 1,
// behind every token the key had.
func TestReapBetweenFirstGrantReadAndTxn(t *testing.T) {
	t.Parallel()
	tb := newBundle(t)
	a, other := tb.backend, sameEtcd(t, tb)
	ctx := testCtx(t)
	landed := false
	a.beforeGrant = func(key string) {
		if landed {
			return
		}
		landed = true
		var l sqllock.Lease
		for i := range 5 {
			var err error
			l, err = other.TryAcquire(ctx, reqFor(key, fmt.Sprintf("other-%d", i)))
			require.NoError(t, err)
			require.NoError(t, other.Release(ctx, l))
		}
		require.Equal(t, int64(5), l.Token)
		expire(t, other, key)
		n, err := other.Reap(ctx, 0, 10)
		require.NoError(t, err)
		require.Equal(t, 1, n)
	}
	l, err := a.TryAcquire(ctx, reqFor("k", "first"))
	require.NoError(t, err)
	require.True(t, landed)
	require.Equal(t, int64(6), l.Token, "a first grant raced by a reap of the key at token 5: G2")
}

// TestReapBetweenSetReadAndTxn: the same for a set's first grant.
func TestReapBetweenSetReadAndTxn(t *testing.T) {
	t.Parallel()
	tb := newBundle(t)
	a, other := tb.backend, sameEtcd(t, tb)
	ctx := testCtx(t)
	// a has seen the floor at 0 (absent) and no record of "k".
	var l sqllock.Lease
	for i := range 3 {
		var err error
		l, err = other.TryAcquire(ctx, reqFor("k", fmt.Sprintf("o%d", i)))
		require.NoError(t, err)
		require.NoError(t, other.Release(ctx, l))
	}
	expire(t, other, "k")
	n, err := other.Reap(ctx, 0, 10)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	ls, err := a.TryAcquireAll(ctx, sqllock.MultiAcquireRequest{Keys: []string{"j", "k"}, TTL: 10 * time.Second, Owner: "set"})
	require.NoError(t, err)
	for _, x := range ls {
		require.Greater(t, x.Token, l.Token, "key %q of a set after a reap it did not see: G2", x.Key)
	}
}

// backdateClock makes the revision etcd is at now look at least age old
// to a reap: a clock entry whose etcd lease was granted with TTL age and
// is gone (revoked), as though it had expired.
func backdateClock(t *testing.T, b *Backend, age time.Duration) {
	t.Helper()
	ctx := testCtx(t)
	resp, err := b.cli.Get(ctx, b.floorKey())
	require.NoError(t, err)
	g, err := b.cli.Grant(ctx, int64(age/time.Second))
	require.NoError(t, err)
	_, err = b.cli.Revoke(ctx, g.ID)
	require.NoError(t, err)
	v, err := json.Marshal(clockEntry{Lease: g.ID, TTL: g.TTL})
	require.NoError(t, err)
	_, err = b.cli.Put(ctx, fmt.Sprintf("%s%020d", b.clockPrefix(), resp.Header.Revision), string(v))
	require.NoError(t, err)
}

// TestReapOlderThanByEtcdClock: with olderThan > 0 a reap deletes a key
// only when its lease ended before a revision the clock knows to be at
// least olderThan old: expired then (its holder gone in etcd's history at
// that revision) or released then with a TTL that ended by now −
// olderThan. Keys that were held at that revision, or released after it,
// stay, as does a held key.
func TestReapOlderThanByEtcdClock(t *testing.T) {
	t.Parallel()
	tb := newBundle(t)
	b := tb.backend
	ctx := testCtx(t)
	acq := func(key string) sqllock.Lease {
		l, err := b.TryAcquire(ctx, reqFor(key, "o-"+key))
		require.NoError(t, err)
		return l
	}
	n, err := b.Reap(ctx, time.Hour, 100)
	require.NoError(t, err)
	require.Zero(t, n, "the first reap starts the clock")

	acq("expired-before")
	expire(t, b, "expired-before")
	require.NoError(t, b.Release(ctx, acq("released-before")))
	late, lateRel := acq("expired-after"), acq("released-after")
	held := acq("held")
	backdateClock(t, b, 2*time.Hour)
	expire(t, b, late.Key)
	require.NoError(t, b.Release(ctx, lateRel))

	n, err = b.Reap(ctx, time.Hour, 100)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	list, err := b.List(ctx, "")
	require.NoError(t, err)
	var keys []string
	for _, i := range list {
		keys = append(keys, i.Key)
	}
	require.Equal(t, []string{"expired-after", "held", "released-after"}, keys,
		"kept: ended after the revision the clock dates, and held")
	_, err = b.TryRenew(ctx, held, 10*time.Second)
	require.NoError(t, err)
	// Ended now, but not an hour ago by the clock: still kept.
	n, err = b.Reap(ctx, time.Hour, 100)
	require.NoError(t, err)
	require.Zero(t, n)
	// The floor took the reaped keys' tokens: they continue above them.
	l := acq("expired-before")
	require.Greater(t, l.Token, int64(1))
}

// TestReapLeavesSemaphores: no key of a semaphore is reaped, neither its
// limit record nor an ended permit (a permit's first grant does not read
// the floor), so a permit's tokens continue and the limit stays.
func TestReapLeavesSemaphores(t *testing.T) {
	t.Parallel()
	b := newBundle(t).backend
	ctx := testCtx(t)
	p1, err := b.TryAcquirePermit(ctx, permitReq("sem", 2, "a"))
	require.NoError(t, err)
	p2, err := b.TryAcquirePermit(ctx, permitReq("sem", 2, "b"))
	require.NoError(t, err)
	require.NoError(t, b.Release(ctx, p2))
	expire(t, b, p2.Key)
	n, err := b.Reap(ctx, 0, 100)
	require.NoError(t, err)
	require.Zero(t, n, "a semaphore's keys are never reaped")
	p3, err := b.TryAcquirePermit(ctx, permitReq("sem", 2, "c"))
	require.NoError(t, err)
	require.Equal(t, p2.Key, p3.Key)
	require.Greater(t, p3.Token, p2.Token)
	require.NoError(t, b.Release(ctx, p1))
}

// TestReapKeepsALiveReleasedLease: a key released before its etcd lease
// ended is kept by a reap with olderThan 0 until etcd no longer knows the
// lease (the release record names it), and then reaped.
func TestReapKeepsALiveReleasedLease(t *testing.T) {
	t.Parallel()
	b := newBundle(t).backend
	ctx := testCtx(t)
	l, err := b.TryAcquire(ctx, reqFor("k", "o"))
	require.NoError(t, err)
	require.NoError(t, b.Release(ctx, l))
	n, err := b.Reap(ctx, 0, 10)
	require.NoError(t, err)
	require.Zero(t, n, "released, its etcd lease alive")
	b.dropSpare(b.recall("k").lease)
	resp, err := b.cli.Get(ctx, b.releaseKey("k"))
	require.NoError(t, err)
	var rel releaseRecord
	require.NoError(t, json.Unmarshal(resp.Kvs[0].Value, &rel))
	require.NotZero(t, rel.Lease)
	require.Equal(t, int64(10), rel.TTL)
	b.dropSpare(rel.Lease)
	_, err = b.cli.Revoke(ctx, clientv3.LeaseID(rel.Lease))
	require.NoError(t, err)
	n, err = b.Reap(ctx, 0, 10)
	require.NoError(t, err)
	require.Equal(t, 1, n)
}

// TestReapWithinMaxTxnOps: a reap of more ended keys than one etcd
// transaction may compare (etcd's default --max-txn-ops, 128: 42 keys of
// 3 compares, and the floor's) splits them, and deletes them all.
func TestReapWithinMaxTxnOps(t *testing.T) {
	t.Parallel()
	b := newBundle(t).backend
	ctx := testCtx(t)
	const keys = 50
	for i := range keys {
		l, err := b.TryAcquire(ctx, reqFor(fmt.Sprintf("k%02d", i), "o"))
		require.NoError(t, err)
		expire(t, b, l.Key)
	}
	n, err := b.Reap(ctx, 0, 1000)
	require.NoError(t, err)
	require.Equal(t, keys, n)
}
