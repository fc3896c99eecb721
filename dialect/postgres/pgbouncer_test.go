package postgres

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/pgtest"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
	"github.com/ashlock/ashlock/sqllock/backendtest"
)

// The Backend through PgBouncer 1.18 (issue 16), in front of a fresh
// database of the shared server. PgBouncer 1.18 refuses startup parameters
// it does not know, search_path among them, so these tests name the schema
// in Options instead.

// bouncerSchema creates a fresh schema in bouncer's database, with the
// lock table migrated into it (directly: the migrations take a session
// lock), and returns its name.
func bouncerSchema(t *testing.T, bouncer *pgtest.Bouncer) string {
	t.Helper()
	var rnd [5]byte
	_, _ = rand.Read(rnd[:])
	schema := "s_" + hex.EncodeToString(rnd[:])
	ctx := testCtx(t)
	conn, err := pgx.Connect(ctx, bouncer.DirectURL)
	require.NoError(t, err)
	_, err = conn.Exec(ctx, "CREATE SCHEMA "+schema)
	require.NoError(t, err)
	require.NoError(t, conn.Close(ctx))
	db, err := pgxpool.New(ctx, bouncer.DirectURL)
	require.NoError(t, err)
	defer db.Close()
	sqlDB := stdlib.OpenDBFromPool(db)
	defer sqlDB.Close()
	require.NoError(t, migrations.Up(ctx, migrations.Postgres, sqlDB, migrations.Options{Schema: schema}))
	return schema
}

// bouncerPool opens a pool through bouncer with the given exec mode, closed
// in t.Cleanup.
func bouncerPool(t *testing.T, bouncer *pgtest.Bouncer, mode pgx.QueryExecMode, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(bouncer.URL)
	require.NoError(t, err)
	cfg.ConnConfig.DefaultQueryExecMode = mode
	if maxConns > 0 {
		cfg.MaxConns = maxConns
	}
	pool, err := pgxpool.NewWithConfig(testCtx(t), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// bouncerBackend is a Backend on a fresh schema through bouncer.
func bouncerBackend(t *testing.T, bouncer *pgtest.Bouncer, mode pgx.QueryExecMode, opts Options) *Backend {
	t.Helper()
	opts.Schema = bouncerSchema(t, bouncer)
	b, err := New(bouncerPool(t, bouncer, mode, 0), opts)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, b.Close()) })
	return b
}

// TestConformancePgBouncer runs the conformance suite through PgBouncer:
// in transaction mode with the settings docs/pgbouncer.md documents (an exec
// mode without named prepared statements, DisableNotify), and in session
// mode with pgx's defaults, notifications included. The batch rules run
// through it in every mode (a Client behind it renews in batches); only
// the Watch rule skips, in transaction mode.
func TestConformancePgBouncer(t *testing.T) {
	t.Parallel()
	t.Run("Transaction", func(t *testing.T) {
		t.Parallel()
		bouncer := pgtest.NewPgBouncer(t, pgtest.PoolTransaction, nil)
		for _, mode := range transactionModes {
			t.Run(mode.String(), func(t *testing.T) {
				t.Parallel()
				backendtest.Run(t, harness(func(t *testing.T) sqllock.Backend {
					b := bouncerBackend(t, bouncer, mode, Options{DisableNotify: true})
					return pollOnly{b, b}
				}, watchRules...))
			})
		}
	})
	t.Run("Session", func(t *testing.T) {
		t.Parallel()
		bouncer := pgtest.NewPgBouncer(t, pgtest.PoolSession, nil)
		backendtest.Run(t, harness(func(t *testing.T) sqllock.Backend {
			return bouncerBackend(t, bouncer, pgx.QueryExecModeCacheStatement, Options{})
		}))
	})
}

// TestPgBouncerMisconfigurationDetected: through PgBouncer in transaction
// mode, pgx's default exec mode (named prepared statements) and LISTEN do
// not work. The first statement of a Backend so configured fails with
// ErrPoolerSettings, which says what to set, and applies nothing; each
// setting is reported only when it is wrong. In session mode the defaults
// work and nothing is reported.
//
// Each case has a PgBouncer of its own: the check sees transaction pooling
// by a server connection changing hands between its two clients, which
// the clients of other cases on the same pooler could hide (a busy pooler
// is the limit documented at ErrPoolerSettings), and then the first
// statement may well succeed.
func TestPgBouncerMisconfigurationDetected(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name         string
		mode         pgx.QueryExecMode
		opts         Options
		want, reject []string // in the message, and not
	}{
		{"Defaults", pgx.QueryExecModeCacheStatement, Options{},
			[]string{"default_query_exec_mode=exec", "DisableNotify"}, nil},
		{"ExecModeOnly", pgx.QueryExecModeCacheStatement, Options{DisableNotify: true},
			[]string{"default_query_exec_mode=exec"}, []string{"DisableNotify"}},
		{"NotifyOnly", pgx.QueryExecModeExec, Options{},
			[]string{"DisableNotify"}, []string{"default_query_exec_mode"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			bouncer := pgtest.NewPgBouncer(t, pgtest.PoolTransaction, nil)
			b := bouncerBackend(t, bouncer, tc.mode, tc.opts)
			ctx := testCtx(t)
			_, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o"})
			t.Log(err)
			require.ErrorIs(t, err, ErrPoolerSettings)
			require.NotErrorIs(t, err, sqllock.ErrIndeterminate, "nothing was sent")
			require.NotErrorIs(t, err, sqllock.ErrUnavailable, "a setting, not a transient failure")
			for _, s := range tc.want {
				require.Contains(t, err.Error(), s)
			}
			for _, s := range tc.reject {
				require.NotContains(t, err.Error(), s)
			}
			// Every later statement says the same; nothing was applied.
			_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o"})
			require.ErrorIs(t, err, ErrPoolerSettings)
			err = b.FencedTx(ctx, sqllock.Lease{Key: "k", Token: 1, Owner: "o"}, func(pgx.Tx) error { return nil })
			require.ErrorIs(t, err, ErrPoolerSettings)
			var n int
			require.NoError(t, b.pool.QueryRow(ctx, "SELECT count(*) FROM "+b.table, pgx.QueryExecModeSimpleProtocol).Scan(&n))
			require.Zero(t, n, "a statement was applied")
		})
	}
	t.Run("SessionModeDefaults", func(t *testing.T) {
		t.Parallel()
		session := pgtest.NewPgBouncer(t, pgtest.PoolSession, nil)
		b := bouncerBackend(t, session, pgx.QueryExecModeCacheStatement, Options{})
		l := acquireOK(t, b, "k", "o", time.Minute)
		require.NoError(t, b.Release(testCtx(t), l))
		require.True(t, b.poolerCheck.done.Load(), "the check ran")
	})
}

// TestPgBouncerForeignStatementClassified: when the check could not tell
// (a busy pooler that happened to give each client its own server
// connection), a statement that meets pgx's prepared statement missing, or
// another client's, says why with ErrPoolerSettings. Here the check is
// skipped, and the measurement is repeated: a second application
// pool starts after a first one has used the pooler, and its acquires meet
// the statements the first one prepared ("already exists", SQLSTATE
// 42P05).
func TestPgBouncerForeignStatementClassified(t *testing.T) {
	t.Parallel()
	bouncer := pgtest.NewPgBouncer(t, pgtest.PoolTransaction, nil)
	schema := bouncerSchema(t, bouncer)
	newApp := func() *Backend {
		b, err := New(bouncerPool(t, bouncer, pgx.QueryExecModeCacheStatement, 0), Options{Schema: schema, DisableNotify: true})
		require.NoError(t, err)
		t.Cleanup(func() { b.Close() })
		b.poolerCheck.done.Store(true) // as if the check had seen nothing
		return b
	}
	ctx := testCtx(t)
	first := newApp()
	for i := range 5 {
		_, err := first.TryAcquire(ctx, sqllock.AcquireRequest{Key: fmt.Sprint("first-", i), TTL: time.Minute, Owner: "first"})
		if err != nil {
			require.ErrorIs(t, err, ErrPoolerSettings) // may already meet it
		}
	}
	second := newApp()
	failed := 0
	const attempts = 20
	for i := range attempts {
		_, err := second.TryAcquire(ctx, sqllock.AcquireRequest{Key: fmt.Sprint("second-", i), TTL: time.Minute, Owner: "second"})
		if err == nil {
			continue
		}
		failed++
		t.Log(err)
		require.ErrorIs(t, err, ErrPoolerSettings)
		require.Contains(t, err.Error(), "default_query_exec_mode=exec")
		require.NotErrorIs(t, err, sqllock.ErrIndeterminate)
	}
	require.Positive(t, failed, "no acquire met another client's prepared statement")
	t.Logf("second pool through PgBouncer in transaction mode with pgx's defaults: %d of %d acquires failed, each with ErrPoolerSettings", failed, attempts)
}

// TestPgBouncerSessionNotifies: in session mode a waiter is woken by the
// release's notification. Its backoff and the holder's lease are far
// longer than the wait allowed, so only a notification can wake it in time.
func TestPgBouncerSessionNotifies(t *testing.T) {
	t.Parallel()
	bouncer := pgtest.NewPgBouncer(t, pgtest.PoolSession, nil)
	b := bouncerBackend(t, bouncer, pgx.QueryExecModeCacheStatement, Options{})
	slow := func(int) time.Duration { return time.Hour }
	holder, err := sqllock.New(b, sqllock.Options{TTL: time.Hour})
	require.NoError(t, err)
	waiter, err := sqllock.New(b, sqllock.Options{TTL: time.Hour, Backoff: slow})
	require.NoError(t, err)
	ctx := testCtx(t)
	defer holder.Close(ctx)
	defer waiter.Close(ctx)
	g, err := holder.TryAcquire(ctx, "k", nil)
	require.NoError(t, err)
	type result struct {
		g  *sqllock.Guard
		at time.Time
	}
	got := make(chan result, 1)
	errc := make(chan error, 1)
	go func() {
		wg, err := waiter.Acquire(ctx, "k", &sqllock.AcquireOptions{Wait: 30 * time.Second})
		if err != nil {
			errc <- err
			return
		}
		got <- result{wg, time.Now()}
	}()
	// The waiter has been refused once, marked the lease and listens.
	require.Eventually(t, func() bool {
		var waited bool
		err := b.pool.QueryRow(ctx, "SELECT waited FROM "+b.table+" WHERE key = 'k'").Scan(&waited)
		return err == nil && waited
	}, 10*time.Second, 10*time.Millisecond, "the waiter never marked the lease")
	require.Eventually(t, func() bool {
		b.mu.Lock()
		l := b.listener
		b.mu.Unlock()
		if l == nil {
			return false
		}
		l.mu.Lock()
		defer l.mu.Unlock()
		return l.pid != 0
	}, 10*time.Second, 10*time.Millisecond, "the listener never listened")
	released := time.Now()
	require.NoError(t, g.Release(ctx))
	select {
	case r := <-got:
		require.Equal(t, g.Token()+1, r.g.Token())
		t.Logf("session mode: waiter woken %v after the release (its backoff: 1h)", r.at.Sub(released).Round(time.Millisecond))
		require.NoError(t, r.g.Release(ctx))
	case err := <-errc:
		t.Fatal(err)
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter was not woken within 10s of the release: no notification through PgBouncer in session mode")
	}
}
