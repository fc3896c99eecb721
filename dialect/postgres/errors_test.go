package postgres

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// poolWith returns a pool on bundle's schema whose sessions have params set.
func poolWith(t *testing.T, bundle *testBundle, params map[string]string) *pgxpool.Pool {
	t.Helper()
	return newPool(t, bundle, func(cfg *pgxpool.Config) {
		for k, v := range params {
			cfg.ConnConfig.RuntimeParams[k] = v
		}
	})
}

// requireSentinel checks that err matches a sqllock sentinel and says what
// happened: callers never have to know pgx.
func requireSentinel(t *testing.T, err, sentinel error, contains string) {
	t.Helper()
	t.Log(err)
	require.ErrorIs(t, err, sentinel)
	require.Contains(t, err.Error(), contains)
}

// holdRows starts a transaction that locks keys' rows (every one must
// exist) with lock, "FOR UPDATE" or "FOR SHARE" (as a fenced transaction
// does), and rolls it back when the test ends unless it ended before.
func holdRows(t *testing.T, pool *pgxpool.Pool, table, lock string, keys ...string) pgx.Tx {
	t.Helper()
	tx, err := pool.Begin(testCtx(t))
	require.NoError(t, err)
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	tag, err := tx.Exec(testCtx(t), "SELECT FROM "+table+" WHERE key = ANY($1) "+lock, keys)
	require.NoError(t, err)
	require.EqualValues(t, len(keys), tag.RowsAffected())
	return tx
}

// lockRows starts a transaction that holds keys' rows FOR UPDATE until the
// returned function rolls it back.
func lockRows(t *testing.T, pool *pgxpool.Pool, table string, keys ...string) (pid uint32, rollback func()) {
	t.Helper()
	tx := holdRows(t, pool, table, "FOR UPDATE", keys...)
	var once bool
	rollback = func() {
		if !once {
			once = true
			require.NoError(t, tx.Rollback(context.Background()))
		}
	}
	t.Cleanup(rollback)
	return tx.Conn().PgConn().PID(), rollback
}

// blockedBy waits until a session is blocked by pid and returns its pid.
func blockedBy(t *testing.T, pool *pgxpool.Pool, pid uint32) int32 {
	t.Helper()
	var blocked int32
	require.Eventually(t, func() bool {
		err := pool.QueryRow(testCtx(t), "SELECT pid FROM pg_stat_activity WHERE $1::int = ANY(pg_blocking_pids(pid)) LIMIT 1", int32(pid)).Scan(&blocked)
		if errors.Is(err, pgx.ErrNoRows) {
			return false
		}
		require.NoError(t, err)
		return true
	}, 10*time.Second, 2*time.Millisecond, "no session blocked by %d", pid)
	return blocked
}

func TestErrors(t *testing.T) {
	t.Parallel()

	t.Run("SchemaMissing", func(t *testing.T) {
		t.Parallel()
		bundle := newBundle(t, Options{})
		b := bundle.backend
		l := acquireOK(t, b, "k", "o1", time.Minute)
		_, err := bundle.db.Pool.Exec(testCtx(t), "DROP TABLE "+b.table)
		require.NoError(t, err)

		ctx := testCtx(t)
		_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o"})
		requireSentinel(t, err, sqllock.ErrSchemaMissing, "sqllock migrate up")
		_, err = b.TryRenew(ctx, l, time.Minute)
		requireSentinel(t, err, sqllock.ErrSchemaMissing, `table "sqllock_locks" does not exist`)
		requireSentinel(t, b.Release(ctx, l), sqllock.ErrSchemaMissing, "sqllock migrate up")
		_, err = b.List(ctx, "")
		requireSentinel(t, err, sqllock.ErrSchemaMissing, "sqllock migrate up")
		err = b.FencedTx(ctx, l, func(pgx.Tx) error { t.Error("fn ran without a lease"); return nil })
		requireSentinel(t, err, sqllock.ErrSchemaMissing, "sqllock migrate up")

		// A schema that does not exist either.
		other, err := New(bundle.db.Pool, Options{Schema: "no_such_schema"})
		require.NoError(t, err)
		_, err = other.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o"})
		requireSentinel(t, err, sqllock.ErrSchemaMissing, "sqllock migrate up")
	})

	t.Run("ReadOnly", func(t *testing.T) {
		t.Parallel()
		bundle := newBundle(t, Options{})
		l := acquireOK(t, bundle.backend, "k", "o1", time.Minute)
		ro, err := New(poolWith(t, bundle, map[string]string{"default_transaction_read_only": "on"}), Options{})
		require.NoError(t, err)
		ctx := testCtx(t)

		_, err = ro.TryAcquire(ctx, sqllock.AcquireRequest{Key: "new", TTL: time.Minute, Owner: "o"})
		requireSentinel(t, err, sqllock.ErrUnavailable, "read-only")
		require.NotErrorIs(t, err, sqllock.ErrIndeterminate)
		// Even a refusal: the statement is a write, refused as a whole.
		_, err = ro.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o"})
		requireSentinel(t, err, sqllock.ErrUnavailable, "read-only")
		_, err = ro.TryRenew(ctx, l, time.Minute)
		requireSentinel(t, err, sqllock.ErrUnavailable, "read-only")
		require.NotErrorIs(t, err, sqllock.ErrLeaseLost)
		requireSentinel(t, ro.Release(ctx, l), sqllock.ErrUnavailable, "read-only")
		infos, err := ro.List(ctx, "")
		require.NoError(t, err)
		require.Len(t, infos, 1)
		require.True(t, infos[0].Held, "the lease survived the read-only attempts")
	})

	t.Run("ContextEndsInFlight", func(t *testing.T) {
		t.Parallel()
		bundle := newBundle(t, Options{})
		b := bundle.backend
		held := acquireOK(t, b, "held", "o1", time.Minute)
		expired := acquireOK(t, b, "expired", "o1", time.Minute)
		expire(t, b, "expired")
		// Every statement below waits on these row locks until its context
		// ends.
		_, rollback := lockRows(t, bundle.db.Pool, b.table, "held", "expired")
		// Each of them loses its connection when its context ends: open
		// them beforehand, so that the deadline cannot pass while dialing
		// on a loaded machine (that error is "unavailable", not
		// "indeterminate": nothing was sent).
		var conns []*pgxpool.Conn
		for range 3 {
			c, err := bundle.db.Pool.Acquire(testCtx(t))
			require.NoError(t, err)
			conns = append(conns, c)
		}
		for _, c := range conns {
			c.Release()
		}

		short := func() context.Context {
			ctx, cancel := context.WithTimeout(context.Background(), time.Second)
			t.Cleanup(cancel)
			return ctx
		}
		_, err := b.TryAcquire(short(), sqllock.AcquireRequest{Key: "expired", TTL: time.Minute, Owner: "o2"})
		requireSentinel(t, err, sqllock.ErrIndeterminate, "may have committed")
		require.ErrorIs(t, err, context.DeadlineExceeded)

		requireSentinel(t, b.Release(short(), held), sqllock.ErrIndeterminate, "may have committed")

		_, err = b.TryRenew(short(), held, time.Minute)
		requireSentinel(t, err, sqllock.ErrUnavailable, "in flight")
		require.NotErrorIs(t, err, sqllock.ErrIndeterminate)
		require.NotErrorIs(t, err, sqllock.ErrLeaseLost)

		// A context that ended before sending: definitely not applied.
		cancelled, cancel := context.WithCancel(context.Background())
		cancel()
		_, err = b.TryAcquire(cancelled, sqllock.AcquireRequest{Key: "expired", TTL: time.Minute, Owner: "o3"})
		require.ErrorIs(t, err, context.Canceled)
		require.NotErrorIs(t, err, sqllock.ErrIndeterminate)

		// The abandoned statements still wait on the server and may commit
		// once the rows are free. Retrying the same request (same owner)
		// gives one tenure either way: the token advances exactly once.
		rollback()
		l, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "expired", TTL: time.Minute, Owner: "o2"})
		require.NoError(t, err)
		require.Equal(t, expired.Token+1, l.Token)
		l2, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "expired", TTL: time.Minute, Owner: "o2"})
		require.NoError(t, err)
		require.Equal(t, l.Token, l2.Token)
		_, err = b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "expired", TTL: time.Minute, Owner: "o4"})
		require.ErrorIs(t, err, sqllock.ErrNotAcquired)
	})

	t.Run("AdminShutdownInFlight", func(t *testing.T) {
		t.Parallel()
		bundle := newBundle(t, Options{})
		b := bundle.backend
		acquireOK(t, b, "k", "o1", time.Minute)
		expire(t, b, "k")
		blocker, _ := lockRows(t, bundle.db.Pool, b.table, "k")

		done := make(chan error, 1)
		go func() {
			_, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o2"})
			done <- err
		}()
		victim := blockedBy(t, bundle.db.Pool, blocker)
		_, err := bundle.db.Pool.Exec(testCtx(t), "SELECT pg_terminate_backend($1)", victim)
		require.NoError(t, err)
		err = <-done
		// The server aborted the statement and said so: not applied.
		requireSentinel(t, err, sqllock.ErrUnavailable, "shutting down")
		require.NotErrorIs(t, err, sqllock.ErrIndeterminate)
		pgErr, ok := errors.AsType[*pgconn.PgError](err)
		require.True(t, ok)
		require.Equal(t, "57P01", pgErr.Code)
	})

	t.Run("StatementTimeout", func(t *testing.T) {
		t.Parallel()
		bundle := newBundle(t, Options{})
		acquireOK(t, bundle.backend, "k", "o1", time.Minute)
		expire(t, bundle.backend, "k")
		b, err := New(poolWith(t, bundle, map[string]string{"statement_timeout": "100"}), Options{})
		require.NoError(t, err)
		lockRows(t, bundle.db.Pool, b.table, "k")
		_, err = b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o2"})
		requireSentinel(t, err, sqllock.ErrUnavailable, "statement_timeout")
		require.NotErrorIs(t, err, sqllock.ErrIndeterminate)
	})

	t.Run("Unreachable", func(t *testing.T) {
		t.Parallel()
		pool, err := pgxpool.New(testCtx(t), "postgres://nobody@127.0.0.1:1/none?connect_timeout=2&sslmode=disable")
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		b, err := New(pool, Options{})
		require.NoError(t, err)
		ctx := testCtx(t)
		_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o"})
		requireSentinel(t, err, sqllock.ErrUnavailable, "cannot connect")
		require.NotErrorIs(t, err, sqllock.ErrIndeterminate)
		requireSentinel(t, b.Release(ctx, sqllock.Lease{Key: "k", Token: 1}), sqllock.ErrUnavailable, "cannot connect")
		_, err = b.List(ctx, "")
		requireSentinel(t, err, sqllock.ErrUnavailable, "cannot connect")
	})
}
