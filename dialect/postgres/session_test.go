package postgres

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// TestNoSessionStateLeft (docs/pitfalls.md#11): the lock operations, the listener
// and FencedTx leave nothing behind in a session — no advisory lock (the
// migrations' session lock included), no open transaction — so a pooler in
// transaction mode, or the next user of a pooled connection, inherits
// nothing.
func TestNoSessionStateLeft(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{}) // migrates: takes and drops goose's session lock
	b := bundle.backend
	ch, stop := b.Watch("k")
	defer stop()
	listening(t, b, ch)
	l := acquireOK(t, b, "k", "o1", time.Minute)
	_, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o2"})
	require.ErrorIs(t, err, sqllock.ErrNotAcquired)
	l, err = b.TryRenew(testCtx(t), l, time.Minute)
	require.NoError(t, err)
	require.NoError(t, b.FencedTx(testCtx(t), l, func(pgx.Tx) error { return nil }))
	boom := errors.New("boom")
	require.ErrorIs(t, b.FencedTx(testCtx(t), l, func(pgx.Tx) error { return boom }), boom)
	require.NoError(t, b.Release(testCtx(t), l))
	_, err = b.List(testCtx(t), "")
	require.NoError(t, err)

	// Every session of this test's pool, and the listener's.
	var pids []int32
	for _, c := range bundle.db.Pool.AcquireAllIdle(testCtx(t)) {
		pids = append(pids, int32(c.Conn().PgConn().PID()))
		c.Release()
	}
	pids = append(pids, int32(b.listener.listeningPID()))
	require.NotEmpty(t, pids)
	var advisory, inTx int
	require.NoError(t, bundle.db.Pool.QueryRow(testCtx(t), `
SELECT (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = ANY($1)),
       (SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1) AND state LIKE 'idle in transaction%')`,
		pids).Scan(&advisory, &inTx))
	require.Zero(t, advisory, "advisory locks left in sessions %v", pids)
	require.Zero(t, inTx, "sessions left in a transaction among %v", pids)
}

// TestPoolExhausted (river#1077): when the application holds every
// connection of the pool, a renewal cannot get one. Its attempt is
// abandoned at its bound, not sent, and the Backend then renews (and
// releases) over its aside connection: the guard keeps its lease for as
// long as the application starves the pool, instead of losing it at its
// local deadline. Acquires stay on the pool: one fails, not sent, and
// locking works again once connections are back.
func TestPoolExhausted(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	pool := poolSized(t, bundle, 2, nil)
	b, err := New(pool, Options{})
	require.NoError(t, err)
	defer b.Close()
	const ttl = 3 * time.Second
	c, err := sqllock.New(b, sqllock.Options{TTL: ttl, Margin: time.Second})
	require.NoError(t, err)
	defer c.Close(testCtx(t))
	g, err := c.TryAcquire(testCtx(t), "k", nil)
	require.NoError(t, err)

	// The application takes every connection and keeps them.
	var held []*pgxpool.Conn
	for range 2 {
		conn, err := pool.Acquire(testCtx(t))
		require.NoError(t, err)
		held = append(held, conn)
	}
	defer func() {
		for _, conn := range held {
			conn.Release()
		}
	}()
	select {
	case <-g.Done():
		t.Fatalf("the guard was lost to a starved pool: %v", context.Cause(g.Context()))
	case <-time.After(2 * ttl):
	}
	require.True(t, b.aside.active(), "renewals went aside")
	// An acquire that ends while waiting for a connection sent nothing:
	// its outcome is known (not applied), not indeterminate.
	short, cancel := context.WithTimeout(testCtx(t), 100*time.Millisecond)
	_, err = b.TryAcquire(short, sqllock.AcquireRequest{Key: "other", TTL: time.Minute, Owner: "o"})
	cancel()
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.NotErrorIs(t, err, sqllock.ErrIndeterminate, "%v", err)
	require.ErrorContains(t, err, "not sent")
	// The release goes aside too.
	require.NoError(t, g.Release(testCtx(t)))
	for _, conn := range held {
		conn.Release()
	}
	held = nil

	// Back to normal: the key is free at its database deadline at the
	// latest, and acquiring works.
	g2, err := c.Acquire(testCtx(t), "k", &sqllock.AcquireOptions{Wait: 10 * time.Second})
	require.NoError(t, err)
	require.Greater(t, g2.Token(), g.Token())
	require.NoError(t, g2.Release(testCtx(t)))
}
