package mariadb

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// Every operation is one statement, so one round trip, granted or
// refused, renewed or lost, except a release of a lease that was not held
// and unexpired (two): counted by the server (the session's Questions) on
// a one-connection pool, once the statements are prepared.
func TestOneStatementPerOperation(t *testing.T) {
	b, db := newBackend(t)
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)
	questions := func() int64 {
		var name string
		var n int64
		require.NoError(t, db.QueryRowContext(testCtx(t), "SHOW SESSION STATUS LIKE 'Questions'").Scan(&name, &n))
		return n
	}
	count := func(what string, op func(ctx context.Context), want ...int64) {
		t.Helper()
		before := questions()
		op(testCtx(t))
		// The SHOW itself is one question.
		require.Equal(t, append(want, 1)[0], questions()-before-1, "%s: statements", what)
	}
	// Prepare every statement once.
	warm, err := b.TryAcquire(testCtx(t), acq("warm"))
	require.NoError(t, err)
	_, _ = b.TryRenew(testCtx(t), warm, time.Minute)
	_, _ = b.TryRenewBatch(testCtx(t), []sqllock.RenewRequest{{Lease: warm, TTL: time.Minute}})
	_ = b.Release(testCtx(t), warm)
	_, _ = b.List(testCtx(t), "w")

	var l sqllock.Lease
	count("acquire", func(ctx context.Context) { l, err = b.TryAcquire(ctx, acq("k")); require.NoError(t, err) })
	count("refused acquire", func(ctx context.Context) {
		_, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o2"})
		require.ErrorIs(t, err, sqllock.ErrNotAcquired)
	})
	count("renew", func(ctx context.Context) { _, err := b.TryRenew(ctx, l, time.Minute); require.NoError(t, err) })
	count("batch renew", func(ctx context.Context) {
		_, err := b.TryRenewBatch(ctx, []sqllock.RenewRequest{{Lease: l, TTL: time.Minute}, {Lease: warm, TTL: time.Minute}})
		require.NoError(t, err)
	})
	count("release", func(ctx context.Context) { require.NoError(t, b.Release(ctx, l)) })
	// A release that clears nothing, or an expired lease, takes a second
	// statement, which tells why.
	count("repeated release", func(ctx context.Context) { require.NoError(t, b.Release(ctx, l)) }, 2)
	count("lost renew", func(ctx context.Context) {
		_, err := b.TryRenew(ctx, l, time.Minute)
		require.ErrorIs(t, err, sqllock.ErrLeaseLost)
	})
	count("list", func(ctx context.Context) { _, err := b.List(ctx, ""); require.NoError(t, err) })
}
