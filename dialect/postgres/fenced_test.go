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

func TestFencedTx(t *testing.T) {
	t.Parallel()

	type fencedBundle struct {
		*testBundle
		b *Backend
	}
	setup := func(t *testing.T) *fencedBundle {
		t.Helper()
		bundle := newBundle(t, Options{})
		_, err := bundle.db.Pool.Exec(testCtx(t), "CREATE TABLE resource (k text PRIMARY KEY, n bigint NOT NULL)")
		require.NoError(t, err)
		return &fencedBundle{bundle, bundle.backend}
	}
	count := func(t *testing.T, tb *fencedBundle) int64 {
		var n int64
		err := tb.db.Pool.QueryRow(testCtx(t), "SELECT coalesce(sum(n), 0) FROM resource").Scan(&n)
		require.NoError(t, err)
		return n
	}
	write := func(tx pgx.Tx) error {
		_, err := tx.Exec(context.Background(), "INSERT INTO resource VALUES ('r', 1) ON CONFLICT (k) DO UPDATE SET n = resource.n + 1")
		return err
	}

	t.Run("CommitsWhileHeld", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		l := acquireOK(t, tb.b, "k", "o1", time.Minute)
		require.NoError(t, tb.b.FencedTx(testCtx(t), l, write))
		require.NoError(t, tb.b.FencedTx(testCtx(t), l, write))
		require.EqualValues(t, 2, count(t, tb))
	})

	t.Run("LostLeaseRunsNothing", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		never := func(pgx.Tx) error { t.Error("fn ran without a valid lease"); return nil }
		l := acquireOK(t, tb.b, "k", "o1", time.Minute)
		expire(t, tb.b, "k")
		err := tb.b.FencedTx(testCtx(t), l, never)
		require.Equal(t, sqllock.LostExpired, lostAs(t, err).Reason)

		l2 := acquireOK(t, tb.b, "k", "o2", time.Minute)
		le := lostAs(t, tb.b.FencedTx(testCtx(t), l, never))
		require.Equal(t, sqllock.LostTaken, le.Reason)
		require.Equal(t, l2.Token, le.Current)

		require.NoError(t, tb.b.Release(testCtx(t), l2))
		require.Equal(t, sqllock.LostReleased, lostAs(t, tb.b.FencedTx(testCtx(t), l2, never)).Reason)
		require.Zero(t, count(t, tb))
	})

	t.Run("ErrorRollsBack", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		l := acquireOK(t, tb.b, "k", "o1", time.Minute)
		boom := errors.New("boom")
		err := tb.b.FencedTx(testCtx(t), l, func(tx pgx.Tx) error {
			require.NoError(t, write(tx))
			return boom
		})
		require.Same(t, boom, err)
		require.Zero(t, count(t, tb))
		// The share lock is gone with the transaction: the holder renews.
		_, err = tb.b.TryRenew(testCtx(t), l, time.Minute)
		require.NoError(t, err)
	})

	// While fn runs, the lease expires, yet no one can take the key until
	// the transaction ends: the taker's UPDATE waits on the share lock.
	t.Run("BlocksTakeoverUntilCommit", func(t *testing.T) {
		t.Parallel()
		tb := setup(t)
		// Long enough for FencedTx to lock the row before expiry on a
		// loaded machine, short enough to wait out.
		l := acquireOK(t, tb.b, "k", "o1", 4*time.Second)
		taken := make(chan sqllock.Lease, 1)
		err := tb.b.FencedTx(testCtx(t), l, func(tx pgx.Tx) error {
			require.Eventually(t, func() bool {
				var past bool
				require.NoError(t, tb.db.Pool.QueryRow(testCtx(t), "SELECT clock_timestamp() > $1", l.Deadline).Scan(&past))
				return past
			}, 20*time.Second, 10*time.Millisecond, "the lease never expired by the database clock")
			go func() {
				l2, err := tb.b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o2"})
				if err != nil {
					t.Errorf("takeover after the fenced transaction: %v", err)
				}
				taken <- l2
			}()
			blockedBy(t, tb.db.Pool, tx.Conn().PgConn().PID())
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
		require.EqualValues(t, 1, count(t, tb))
	})

	t.Run("BadLease", func(t *testing.T) {
		t.Parallel()
		b, err := New(&pgxpool.Pool{}, Options{})
		require.NoError(t, err)
		err = b.FencedTx(testCtx(t), sqllock.Lease{Key: "k"}, func(pgx.Tx) error { return nil })
		require.ErrorIs(t, err, sqllock.ErrInvalidToken)
	})
}

func lostAs(t *testing.T, err error) *sqllock.LostError {
	t.Helper()
	le, ok := errors.AsType[*sqllock.LostError](err)
	require.True(t, ok, "want a *sqllock.LostError, got %v", err)
	require.ErrorIs(t, err, sqllock.ErrLeaseLost)
	return le
}
