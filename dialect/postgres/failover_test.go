package postgres

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// TestReadOnlyConnectionDiscarded: after a failover (river#1225, Aurora) the
// pool keeps connections to a server that is now read-only, where every
// write fails with SQLSTATE 25006, although a new connection would reach the
// new primary. The backend must not hand such a connection back to the pool
// for reuse: the operation that met it fails (not applied, transient), and
// the next one runs on a fresh connection. Here the pool's one connection is
// made read-only by a session setting, which a new connection does not
// have.
func TestReadOnlyConnectionDiscarded(t *testing.T) {
	t.Parallel()
	// keep(l) stores a new lease in l unless there was an error.
	keep := func(l *sqllock.Lease) func(sqllock.Lease, error) error {
		return func(nl sqllock.Lease, err error) error {
			if err == nil {
				*l = nl
			}
			return err
		}
	}
	for _, op := range []struct {
		name string
		run  func(ctx context.Context, b *Backend, l *sqllock.Lease) error
	}{{
		name: "Acquire", // the same owner's retry
		run: func(ctx context.Context, b *Backend, l *sqllock.Lease) error {
			return keep(l)(b.TryAcquire(ctx, sqllock.AcquireRequest{Key: l.Key, TTL: time.Minute, Owner: l.Owner}))
		},
	}, {
		name: "Renew",
		run: func(ctx context.Context, b *Backend, l *sqllock.Lease) error {
			return keep(l)(b.TryRenew(ctx, *l, time.Minute))
		},
	}, {
		name: "FencedTx",
		run: func(ctx context.Context, b *Backend, l *sqllock.Lease) error {
			return b.FencedTx(ctx, *l, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "SELECT 1")
				return err
			})
		},
	}, {
		name: "Release",
		run: func(ctx context.Context, b *Backend, l *sqllock.Lease) error {
			return b.Release(ctx, *l)
		},
	}} {
		t.Run(op.name, func(t *testing.T) {
			t.Parallel()
			b, _, poison, pid := readOnlyFixture(t)
			ctx := testCtx(t)
			l := acquireOK(t, b, "k", "o1", time.Minute)
			poisoned := poison()
			err := op.run(ctx, b, &l)
			requireSentinel(t, err, sqllock.ErrUnavailable, "read-only")
			require.NotErrorIs(t, err, sqllock.ErrIndeterminate)
			require.NotErrorIs(t, err, sqllock.ErrLeaseLost)
			require.NoError(t, op.run(ctx, b, &l), "after a read-only error: the next attempt must get a fresh connection")
			require.NotEqual(t, poisoned, pid(), "the read-only connection went back to the pool")
			require.Equal(t, op.name != "Release", listOne(t, b, "k").Held)
		})
	}

	// A renewing Guard survives: its next renewal after the failed one
	// reaches the "new primary".
	t.Run("Guard", func(t *testing.T) {
		t.Parallel()
		b, pool, poison, pid := readOnlyFixture(t)
		ctx := testCtx(t)
		const ttl = 2 * time.Second
		c, err := sqllock.New(b, sqllock.Options{TTL: ttl})
		require.NoError(t, err)
		t.Cleanup(func() { c.Close(context.Background()) })
		g, err := c.TryAcquire(ctx, "g", nil)
		require.NoError(t, err)
		dials := pool.Stat().NewConnsCount()
		poisoned := poison()
		select {
		case <-g.Done():
			t.Fatalf("the guard was lost while its pool held a read-only connection: %v", context.Cause(g.Context()))
		case <-time.After(2 * ttl):
		}
		require.Greater(t, pool.Stat().NewConnsCount(), dials, "no renewal met the read-only connection")
		require.NotEqual(t, poisoned, pid())
		require.NoError(t, g.Release(ctx))
	})
}

// readOnlyFixture returns a Backend on a pool of one connection, a function
// that makes that connection read-only (as a primary demoted under it would
// be) and returns its pid, and one that returns the pid of the pool's
// connection now.
func readOnlyFixture(t *testing.T) (b *Backend, pool *pgxpool.Pool, poison, pid func() uint32) {
	t.Helper()
	bundle := newBundle(t, Options{})
	pool = poolSized(t, bundle, 1, nil)
	b, err := New(pool, Options{})
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })
	ctx := testCtx(t)
	pid = func() uint32 {
		c, err := pool.Acquire(ctx)
		require.NoError(t, err)
		defer c.Release()
		return c.Conn().PgConn().PID()
	}
	poison = func() uint32 {
		c, err := pool.Acquire(ctx)
		require.NoError(t, err)
		defer c.Release()
		_, err = c.Exec(ctx, "SET default_transaction_read_only = on")
		require.NoError(t, err)
		return c.Conn().PgConn().PID()
	}
	return b, pool, poison, pid
}
