package postgres

import (
	"context"
	"database/sql"
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// FencedSQLTx keeps FencedTx's rule on a *sql.Tx, on both drivers: the
// lease row FOR SHARE with its token and a live deadline, fn run and
// committed only under it.
func TestFencedSQLTx(t *testing.T) {
	t.Parallel()
	write := func(tx *sql.Tx) error {
		_, err := tx.ExecContext(context.Background(), "INSERT INTO resource VALUES ('r', 1) ON CONFLICT (k) DO UPDATE SET n = resource.n + 1")
		return err
	}
	never := func(t *testing.T) func(*sql.Tx) error {
		return func(*sql.Tx) error { t.Error("fn ran without a valid lease"); return nil }
	}
	for _, d := range sqlDrivers {
		setup := func(t *testing.T) (*testBundle, *Backend, func() int64) {
			t.Helper()
			bundle, b := dbBundle(t, d, Options{})
			_, err := bundle.db.Pool.Exec(testCtx(t), "CREATE TABLE resource (k text PRIMARY KEY, n bigint NOT NULL)")
			require.NoError(t, err)
			return bundle, b, func() int64 {
				var n int64
				require.NoError(t, bundle.db.Pool.QueryRow(testCtx(t), "SELECT coalesce(sum(n), 0) FROM resource").Scan(&n))
				return n
			}
		}
		t.Run(d.name+"/CommitsWhileHeld", func(t *testing.T) {
			t.Parallel()
			_, b, count := setup(t)
			l := acquireOK(t, b, "k", "o1", time.Minute)
			require.NoError(t, b.FencedSQLTx(testCtx(t), l, write))
			require.NoError(t, b.FencedSQLTx(testCtx(t), l, write))
			require.EqualValues(t, 2, count())
		})
		t.Run(d.name+"/LostLeaseRunsNothing", func(t *testing.T) {
			t.Parallel()
			_, b, count := setup(t)
			l := acquireOK(t, b, "k", "o1", time.Minute)
			expire(t, b, "k")
			require.Equal(t, sqllock.LostExpired, lostAs(t, b.FencedSQLTx(testCtx(t), l, never(t))).Reason)
			l2 := acquireOK(t, b, "k", "o2", time.Minute)
			le := lostAs(t, b.FencedSQLTx(testCtx(t), l, never(t)))
			require.Equal(t, sqllock.LostTaken, le.Reason)
			require.Equal(t, l2.Token, le.Current)
			require.NoError(t, b.Release(testCtx(t), l2))
			require.Equal(t, sqllock.LostReleased, lostAs(t, b.FencedSQLTx(testCtx(t), l2, never(t))).Reason)
			require.Zero(t, count())
		})
		t.Run(d.name+"/ErrorRollsBack", func(t *testing.T) {
			t.Parallel()
			_, b, count := setup(t)
			l := acquireOK(t, b, "k", "o1", time.Minute)
			boom := errors.New("boom")
			err := b.FencedSQLTx(testCtx(t), l, func(tx *sql.Tx) error {
				require.NoError(t, write(tx))
				return boom
			})
			require.Same(t, boom, err)
			require.Zero(t, count())
			_, err = b.TryRenew(testCtx(t), l, time.Minute)
			require.NoError(t, err, "the share lock outlived the transaction")
		})
		// While fn runs the lease expires, yet nobody takes the key until
		// the transaction ends.
		t.Run(d.name+"/BlocksTakeoverUntilCommit", func(t *testing.T) {
			t.Parallel()
			bundle, b, count := setup(t)
			l := acquireOK(t, b, "k", "o1", 4*time.Second)
			taken := make(chan sqllock.Lease, 1)
			err := b.FencedSQLTx(testCtx(t), l, func(tx *sql.Tx) error {
				var pid uint32
				require.NoError(t, tx.QueryRowContext(testCtx(t), "SELECT pg_backend_pid()").Scan(&pid))
				require.Eventually(t, func() bool {
					var past bool
					require.NoError(t, bundle.db.Pool.QueryRow(testCtx(t), "SELECT clock_timestamp() > $1", l.Deadline).Scan(&past))
					return past
				}, 20*time.Second, 10*time.Millisecond, "the lease never expired by the database clock")
				go func() {
					l2, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o2"})
					if err != nil {
						t.Errorf("takeover after the fenced transaction: %v", err)
					}
					taken <- l2
				}()
				blockedBy(t, bundle.db.Pool, pid)
				select {
				case <-taken:
					t.Error("the key was taken while the fenced transaction ran")
				default:
				}
				return write(tx)
			})
			require.NoError(t, err)
			l2 := <-taken
			require.Equal(t, l.Token+1, l2.Token)
			require.EqualValues(t, 1, count())
		})
		// Fence on the application's own transaction (GORM's, sqlx's,
		// bun's): the same rule, the commit the caller's.
		t.Run(d.name+"/FenceOnOwnTx", func(t *testing.T) {
			t.Parallel()
			_, b, count := setup(t)
			l := acquireOK(t, b, "k", "o1", time.Minute)
			tx, err := b.db.BeginTx(testCtx(t), nil)
			require.NoError(t, err)
			require.NoError(t, b.Fence(testCtx(t), tx, l))
			require.NoError(t, write(tx))
			require.NoError(t, tx.Commit())
			require.EqualValues(t, 1, count())

			expire(t, b, "k")
			tx, err = b.db.BeginTx(testCtx(t), nil)
			require.NoError(t, err)
			defer tx.Rollback()
			require.Equal(t, sqllock.LostExpired, lostAs(t, b.Fence(testCtx(t), tx, l)).Reason)
		})
		// A commit answered after its context ended may not have waited
		// for the synchronous standbys: indeterminate, never a success.
		t.Run(d.name+"/CommitAfterContextIsIndeterminate", func(t *testing.T) {
			t.Parallel()
			_, b, _ := setup(t)
			l := acquireOK(t, b, "k", "o1", time.Minute)
			ctx, cancel := context.WithCancel(testCtx(t))
			err := b.FencedSQLTx(ctx, l, func(tx *sql.Tx) error {
				err := write(tx)
				cancel()
				return err
			})
			t.Log(err)
			require.Error(t, err)
			require.ErrorIs(t, err, sqllock.ErrIndeterminate)
		})
	}
	t.Run("WrongConstructor", func(t *testing.T) {
		t.Parallel()
		bundle := newBundle(t, Options{})
		l := acquireOK(t, bundle.backend, "k", "o", time.Minute)
		err := bundle.backend.FencedSQLTx(testCtx(t), l, func(*sql.Tx) error { return nil })
		require.ErrorContains(t, err, "use FencedTx")
	})
}

// A connection on which the server answers that it is read-only (a
// primary demoted by a failover) goes out of the *sql.DB's pool, as out
// of pgx's: the operation that met it fails, not applied, and the next one
// dials anew.
func TestDBReadOnlyConnectionDiscarded(t *testing.T) {
	t.Parallel()
	for _, d := range sqlDrivers {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			bundle := newBundle(t, Options{})
			db := openDB(t, bundle, d, "")
			db.SetMaxOpenConns(1)
			b := newDBBackend(t, bundle, db, Options{})
			ctx := testCtx(t)
			pid := func(set string) (p int64) {
				c, err := db.Conn(ctx)
				require.NoError(t, err)
				defer c.Close()
				if set != "" {
					_, err = c.ExecContext(ctx, set)
					require.NoError(t, err)
				}
				require.NoError(t, c.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&p))
				return p
			}
			l := acquireOK(t, b, "k", "o1", time.Minute)
			poisoned := pid("SET default_transaction_read_only = on")
			_, err := b.TryRenew(ctx, l, time.Minute)
			requireSentinel(t, err, sqllock.ErrUnavailable, "read-only")
			require.NotErrorIs(t, err, sqllock.ErrLeaseLost)
			_, err = b.TryRenew(ctx, l, time.Minute)
			require.NoError(t, err, "after a read-only error: the next attempt must get a fresh connection")
			require.NotEqual(t, poisoned, pid(""), "the read-only connection went back to the pool")
		})
	}
}
