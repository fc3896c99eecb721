package etcd

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/dialect/etcd/internal/etcdtest"
	"github.com/ashlock/ashlock/sqllock"
)

// counted returns a Backend on a fresh prefix whose client counts its
// calls, and a second Backend (another process, as far as the first can
// tell) on the same prefix.
func counted(t *testing.T) (*Backend, *etcdtest.Calls, *Backend) {
	t.Helper()
	calls := &etcdtest.Calls{}
	cli, err := etcdtest.NewClient(etcdtest.Endpoints(t), calls.DialOptions()...)
	require.NoError(t, err)
	t.Cleanup(func() { cli.Close() })
	other := newBundle(t).backend
	b, err := New(cli, Options{Prefix: other.Prefix()})
	require.NoError(t, err)
	// No spares granted ahead, in the background: they would count in
	// the steps (TestAcquireTakesWarmSpares counts them).
	b.warmTo = 0
	return b, calls, other
}

// TestRoundTrips counts the gRPC calls of every operation: the figures of
// the package doc and docs/etcd.md. Each is one round trip, but for the
// keep-alive of a spare etcd lease, sent together with the acquire's
// transaction (one round trip of latency for both).
func TestRoundTrips(t *testing.T) {
	t.Parallel()
	b, calls, other := counted(t)
	ctx := testCtx(t)
	req := func(key, owner string) sqllock.AcquireRequest {
		return sqllock.AcquireRequest{Key: key, TTL: 10 * time.Second, Owner: owner}
	}
	var figures []string
	step := func(name string, want int, fn func()) {
		t.Helper()
		calls.Take()
		fn()
		n, by := calls.Take()
		figures = append(figures, fmt.Sprintf("%s=%d", name, n))
		if n != want {
			t.Errorf("%s: %d round trips (%s), want %d", name, n, by, want)
		}
	}
	var (
		l   sqllock.Lease
		err error
	)
	step("acquire", 2, func() { l, err = b.TryAcquire(ctx, req("k", "o1")); require.NoError(t, err) })
	step("renew", 2, func() { l, err = b.TryRenew(ctx, l, 10*time.Second); require.NoError(t, err) })
	step("renew_longer_ttl", 4, func() { l, err = b.TryRenew(ctx, l, 20*time.Second); require.NoError(t, err) })
	// A Backend that has not seen the holder's etcd lease reads it first.
	fresh, err := New(b.cli, Options{Prefix: b.Prefix()})
	require.NoError(t, err)
	step("renew_unseen", 3, func() { l, err = fresh.TryRenew(ctx, l, 20*time.Second); require.NoError(t, err) })
	step("fenced", 1, func() {
		_, err := b.Fenced(ctx, l, clientv3.OpPut(b.Prefix()+"data", "x"))
		require.NoError(t, err)
	})
	step("release", 1, func() { require.NoError(t, b.Release(ctx, l)) })
	step("release_repeat", 1, func() { require.NoError(t, b.Release(ctx, l)) })
	step("acquire_released", 2, func() { l, err = b.TryAcquire(ctx, req("k", "o2")); require.NoError(t, err) })
	// The deadline of a lease this Backend granted or renewed is the one it
	// reported; another Backend asks etcd for the time-to-live.
	step("list_1_held", 1, func() { _, err := b.List(ctx, ""); require.NoError(t, err) })
	step("list_1_held_unseen", 2, func() { _, err := fresh.List(ctx, ""); require.NoError(t, err) })
	// A batch renewal: the keep-alives pipelined on the Backend's stream
	// (one request each, one round trip of latency together), then one
	// check for all.
	var batch []sqllock.RenewRequest
	for _, k := range []string{"b1", "b2", "b3"} {
		bl, err := b.TryAcquire(ctx, req(k, "o2"))
		require.NoError(t, err)
		batch = append(batch, sqllock.RenewRequest{Lease: bl, TTL: 10 * time.Second})
	}
	step("renew_batch_3", 4, func() {
		res, err := b.TryRenewBatch(ctx, batch)
		require.NoError(t, err)
		for _, r := range res {
			require.NoError(t, r.Err)
		}
	})
	require.NoError(t, b.Release(ctx, l))
	// Another process grants the key: this Backend's hint is stale.
	ol, err := other.TryAcquire(ctx, req("k", "x"))
	require.NoError(t, err)
	require.NoError(t, other.Release(ctx, ol))
	step("acquire_changed_elsewhere", 3, func() { l, err = b.TryAcquire(ctx, req("k", "o3")); require.NoError(t, err) })
	// Refused: the first attempt finds out by granting and is refused by
	// the transaction (the unused etcd lease is revoked, the holder's
	// time-to-live read); a waiter's next attempt reads first.
	_, err = other.TryAcquire(ctx, req("held", "x"))
	require.NoError(t, err)
	var he *sqllock.HeldError
	step("acquire_refused_first", 3, func() {
		_, err := b.TryAcquire(ctx, req("held", "w"))
		require.True(t, errors.As(err, &he), "%v", err)
	})
	step("acquire_refused_again", 2, func() {
		_, err := b.TryAcquire(ctx, req("held", "w"))
		require.True(t, errors.As(err, &he), "%v", err)
	})
	require.Greater(t, he.Remaining, 8*time.Second, "the holder's remaining time from etcd's time-to-live")
	// A min hold: a second lease grant, sent together with the first (one
	// round trip of latency), then the transaction; the release that
	// leaves the hold is one transaction; List knows the hold's end; a
	// refusal costs what acquire_refused_first does.
	hold := req("hold", "o4")
	hold.MinHold = time.Hour
	step("acquire_min_hold", 3, func() { l, err = b.TryAcquire(ctx, hold); require.NoError(t, err) })
	step("release_in_min_hold", 1, func() { require.NoError(t, b.Release(ctx, l)) })
	step("list_1_in_min_hold", 1, func() { _, err := b.List(ctx, "hold"); require.NoError(t, err) })
	// The holder's etcd lease, released, is not kept as a spare of the
	// min hold's TTL (its Deadline was the hold's end): an acquire of that
	// TTL grants a lease of its own, with no keep-alive on a wrong spare.
	long := req("long", "o4")
	long.TTL = time.Hour
	step("acquire_ttl_of_a_min_hold", 2, func() {
		l, err := b.TryAcquire(ctx, long)
		require.NoError(t, err)
		require.Equal(t, time.Hour, l.Deadline.Sub(l.BackendTime), "on an etcd lease of the TTL asked for")
	})
	step("acquire_refused_in_min_hold", 3, func() {
		_, err := b.TryAcquire(ctx, req("hold", "w"))
		require.True(t, errors.As(err, &he), "%v", err)
	})
	t.Logf("etcd round trips: %s", strings.Join(figures, " "))
}
