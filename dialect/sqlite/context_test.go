package sqlite

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// busyAppHandle returns a Backend on an application's handle with one
// connection, and that connection taken by an open transaction of the
// application's until the returned func (or the end of the test) ends it.
func busyAppHandle(t *testing.T) (*Backend, *sql.DB, func()) {
	t.Helper()
	name, err := DSN(filepath.Join(t.TempDir(), "app.db"), Options{})
	require.NoError(t, err)
	db, err := sql.Open("sqlite", name)
	require.NoError(t, err)
	t.Cleanup(func() { db.Close() })
	db.SetMaxOpenConns(1)
	require.NoError(t, migrations.Up(testCtx(t), migrations.SQLite, db, migrations.Options{}))
	b, err := New(db, Options{})
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })
	// Prepare every statement first: a prepared statement waits for its
	// connection inside database/sql, not in PrepareContext.
	l, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "warm", TTL: time.Minute, Owner: "w"})
	require.NoError(t, err)
	_, err = b.TryRenew(testCtx(t), l, time.Minute)
	require.NoError(t, err)
	require.NoError(t, b.Release(testCtx(t), l))
	require.NoError(t, b.Release(testCtx(t), l)) // the peek statement too
	_, err = b.List(testCtx(t), "")
	require.NoError(t, err)
	tx, err := db.BeginTx(testCtx(t), &sql.TxOptions{ReadOnly: true})
	require.NoError(t, err)
	var n int
	require.NoError(t, tx.QueryRow("SELECT count(*) FROM sqllock_locks").Scan(&n))
	end := func() { _ = tx.Rollback() }
	t.Cleanup(end)
	return b, db, end
}

// Issue: every attempt ran under context.WithoutCancel, including
// database/sql's wait for a connection, so on an application's busy handle
// TryAcquire with a 200 ms context returned only when the application's
// transaction ended (3 s). The caller's context bounds that wait; nothing
// is applied.
func TestContextBoundsTheWaitForAConnection(t *testing.T) {
	t.Parallel()
	b, _, end := busyAppHandle(t)
	// The application's transaction ends after 3 s, as in the report; a
	// backend that waits for it anyway returns then instead of hanging.
	timer := time.AfterFunc(3*time.Second, end)
	defer timer.Stop()

	req := sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o"}
	ops := map[string]func(ctx context.Context) error{
		"TryAcquire": func(ctx context.Context) error { _, err := b.TryAcquire(ctx, req); return err },
		"TryRenew": func(ctx context.Context) error {
			_, err := b.TryRenew(ctx, sqllock.Lease{Key: "k", Token: 1, Owner: "o"}, time.Minute)
			return err
		},
		"Release": func(ctx context.Context) error { return b.Release(ctx, sqllock.Lease{Key: "k", Token: 1, Owner: "o"}) },
		"List":    func(ctx context.Context) error { _, err := b.List(ctx, ""); return err },
	}
	// 200 ms, and up to 500 ms more for a loaded 2-core machine: far below
	// the 3 s the application holds its connection.
	const budget, allowance = 200 * time.Millisecond, 500 * time.Millisecond
	for _, name := range []string{"TryAcquire", "TryRenew", "Release", "List"} {
		ctx, cancel := context.WithTimeout(testCtx(t), budget)
		start := time.Now()
		err := ops[name](ctx)
		elapsed := time.Since(start)
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded, name)
		// Not sent because the caller gave up: the context's error alone,
		// not ErrUnavailable (the backend did not fail; internal/outcome).
		require.NotErrorIs(t, err, sqllock.ErrUnavailable, "%s: not sent, the caller gave up", name)
		require.ErrorContains(t, err, "not sent", name)
		require.NotErrorIs(t, err, sqllock.ErrIndeterminate, "%s: nothing was sent", name)
		require.Less(t, elapsed, budget+allowance, "%s waited for the application's connection past its context", name)
	}
	end()
	l, err := b.TryAcquire(testCtx(t), req)
	require.NoError(t, err)
	require.EqualValues(t, 1, l.Token, "no attempt was applied")
}

// shield: the caller's context cancels a statement's context only until
// database/sql converts its arguments (it has the connection then); after
// that, ending the caller's context changes nothing, so the statement is
// never interrupted and its outcome stays known.
func TestShield(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	sctx, args, g, release := shield(ctx, outcome.Acquire, []any{"k", int64(1)})
	v, err := args[0].(driver.Valuer).Value()
	require.NoError(t, err)
	require.Equal(t, "k", v)
	require.Equal(t, int64(1), args[1])
	cancel()
	require.NoError(t, sctx.Err(), "the statement runs: the caller's context no longer reaches it")
	v, err = args[0].(driver.Valuer).Value()
	require.NoError(t, err, "a second conversion (a retry on a bad connection) is decided by the first")
	require.Equal(t, "k", v)
	require.Equal(t, context.Canceled, g.notSent(context.Canceled), "a statement that reached the driver keeps its own error")
	release()
	require.Error(t, sctx.Err(), "release ends the statement's context")

	ctx, cancel = context.WithCancel(context.Background())
	sctx, args, g, release = shield(ctx, outcome.Acquire, []any{"k"})
	defer release()
	cancel()
	<-sctx.Done() // waiting for a connection: the caller's context ends it
	_, err = args[0].(driver.Valuer).Value()
	require.ErrorIs(t, err, context.Canceled, "not sent once the caller's context has ended")
	require.NotErrorIs(t, err, sqllock.ErrUnavailable, "the caller gave up: the context's error alone (internal/outcome)")
	require.ErrorContains(t, err, `sqllock/sqlite: acquire "k": not sent`)
	// database/sql's own error when the wait for a connection ends:
	err = g.notSent(errors.New("sql: statement context cancelled"))
	require.ErrorIs(t, err, context.Canceled)
	require.NotErrorIs(t, err, sqllock.ErrUnavailable)
}
