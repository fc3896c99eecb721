package postgres

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// poolSized returns a pool of at most maxConns connections on bundle's
// schema whose sessions have params set.
func poolSized(t *testing.T, bundle *testBundle, maxConns int32, params map[string]string) *pgxpool.Pool {
	t.Helper()
	return newPool(t, bundle, func(cfg *pgxpool.Config) {
		for k, v := range params {
			cfg.ConnConfig.RuntimeParams[k] = v
		}
		cfg.MaxConns = maxConns
	})
}

// TestSerializableSessions: an application whose sessions default to
// SERIALIZABLE runs the backend's single statements in implicit
// serializable transactions, and contended ones fail with SQLSTATE 40001
// (pglock#29, #39). Such a statement was rolled back by the server, so the
// backend sends it again: callers see only the lock's own outcomes, never a
// serialization failure.
func TestSerializableSessions(t *testing.T) {
	t.Parallel()
	for _, isolation := range []string{"serializable", "repeatable read"} {
		t.Run(isolation, func(t *testing.T) {
			t.Parallel()
			contend(t, isolation)
		})
	}
}

// contend runs 32 goroutines of TryAcquire, TryRenew and Release cycles on
// 3 keys, on a pool of 8 connections whose sessions run at isolation.
func contend(t *testing.T, isolation string) {
	bundle := newBundle(t, Options{})
	pool := poolSized(t, bundle, 8, map[string]string{"default_transaction_isolation": isolation})
	b, err := New(pool, Options{})
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })
	ctx := testCtx(t)
	var got string
	require.NoError(t, pool.QueryRow(ctx, "SHOW transaction_isolation").Scan(&got))
	require.Equal(t, isolation, got)

	const goroutines, cycles, keys = 32, 100, 3
	var (
		granted, refused, renewed, failed atomic.Int64
		mu                                sync.Mutex
		unexpected                        []error
	)
	fail := func(err error) {
		failed.Add(1)
		mu.Lock()
		defer mu.Unlock()
		if len(unexpected) < 10 {
			unexpected = append(unexpected, err)
		}
	}
	cycle := func(round, g int) {
		for i := range cycles {
			req := sqllock.AcquireRequest{Key: fmt.Sprint("k", rand.N(keys)), TTL: time.Minute, Owner: fmt.Sprintf("o%d.%d.%d", round, g, i)}
			l, err := b.TryAcquire(ctx, req)
			if errors.Is(err, sqllock.ErrNotAcquired) {
				refused.Add(1)
				continue
			}
			if err != nil {
				fail(fmt.Errorf("acquire: %w", err))
				continue
			}
			granted.Add(1)
			if i%4 == 0 {
				// Renewals conflict too.
				if nl, err := b.TryRenew(ctx, l, time.Minute); err != nil {
					fail(fmt.Errorf("renew: %w", err))
				} else {
					l = nl
					renewed.Add(1)
				}
			}
			// Nobody else can end a lease of a minute in this test: its
			// release must succeed.
			if err := b.Release(ctx, l); err != nil {
				fail(fmt.Errorf("release: %w", err))
			}
		}
	}
	batch := func(round int) {
		var wg sync.WaitGroup
		for g := range goroutines {
			wg.Go(func() { cycle(round, g) })
		}
		wg.Wait()
	}
	// Conflicts depend on timing: on a machine so loaded that the
	// goroutines hardly overlap, a batch may meet none; run more then.
	rounds := 0
	for rounds < 5 && (rounds == 0 || b.conflictRetries.Load() == 0) {
		rounds++
		batch(rounds)
	}
	retries := b.conflictRetries.Load()
	t.Logf("%d acquires in %d round(s): %d granted (%d renewed), %d refused; %d statements resent after a serialization failure or deadlock",
		rounds*goroutines*cycles, rounds, granted.Load(), renewed.Load(), refused.Load(), retries)
	require.Empty(t, unexpected, "%d unexpected errors", failed.Load())
	require.Positive(t, granted.Load())
	require.Positive(t, retries, "no conflict happened: the test did not test anything")
}

// TestConflictRetriesExhausted: a statement that fails with a serialization
// failure or a deadlock every time is sent conflictAttempts times, and then
// reported as unavailable (not applied), with the cause. A trigger makes
// every write to the lock table fail with the SQLSTATE in its argument.
func TestConflictRetriesExhausted(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	l := acquireOK(t, b, "k", "o1", time.Minute)
	_, err := bundle.db.Pool.Exec(ctx, `CREATE FUNCTION fail_with() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'injected by the test' USING ERRCODE = TG_ARGV[0];
END $$`)
	require.NoError(t, err)
	failWith := func(code string) {
		_, err := bundle.db.Pool.Exec(ctx, "CREATE OR REPLACE TRIGGER fail_with BEFORE INSERT OR UPDATE ON "+b.table+
			" FOR EACH ROW EXECUTE FUNCTION fail_with('"+code+"')")
		require.NoError(t, err)
	}
	resent := func(op string, want int64, run func() error) error {
		t.Helper()
		before := b.conflictRetries.Load()
		err := run()
		require.Equal(t, want, b.conflictRetries.Load()-before, "%s: statements sent again", op)
		return err
	}

	failWith("40001")
	err = resent("acquire", conflictAttempts-1, func() error {
		_, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "new", TTL: time.Minute, Owner: "o"})
		return err
	})
	requireSentinel(t, err, sqllock.ErrUnavailable, "serialization failure each of the 10 times")
	require.NotErrorIs(t, err, sqllock.ErrIndeterminate)
	require.Contains(t, err.Error(), "SQLSTATE 40001")
	// A refusal writes nothing: no conflict.
	err = resent("refused acquire", 0, func() error {
		_, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o"})
		return err
	})
	require.ErrorIs(t, err, sqllock.ErrNotAcquired)
	err = resent("renew", conflictAttempts-1, func() error { _, err := b.TryRenew(ctx, l, time.Minute); return err })
	requireSentinel(t, err, sqllock.ErrUnavailable, "serialization failure")
	require.NotErrorIs(t, err, sqllock.ErrLeaseLost)

	failWith("40P01")
	err = resent("release", conflictAttempts-1, func() error { return b.Release(ctx, l) })
	requireSentinel(t, err, sqllock.ErrUnavailable, "deadlock each of the 10 times")
	require.NotErrorIs(t, err, sqllock.ErrIndeterminate)
	require.True(t, listOne(t, b, "k").Held, "a failed release applied")

	_, err = bundle.db.Pool.Exec(ctx, "DROP TRIGGER fail_with ON "+b.table)
	require.NoError(t, err)
	require.NoError(t, b.Release(ctx, l))
}

// TestConflictRetryContextEnds: when the context ends while the backend
// waits to send a statement again after a conflict, the operation was not
// applied, and the error says so and matches the context's error.
func TestConflictRetryContextEnds(t *testing.T) {
	t.Parallel()
	b := &Backend{table: "t"}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sent := 0
	err := b.retryConflicts(ctx, func() error {
		sent++
		if sent == 3 {
			cancel()
		}
		return &pgconn.PgError{Severity: "ERROR", Code: "40001", Message: "could not serialize access"}
	})
	require.Equal(t, 3, sent)
	require.EqualValues(t, 2, b.conflictRetries.Load())
	err = b.translate(ctx, outcome.Acquire, "k", err)
	requireSentinel(t, err, sqllock.ErrUnavailable, "not applied before the context ended")
	require.ErrorIs(t, err, context.Canceled)
	require.NotErrorIs(t, err, sqllock.ErrIndeterminate)
	require.Contains(t, err.Error(), "SQLSTATE 40001")
}
