package postgres

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// TestReleaseRace: a Release whose snapshot sees its lease held and valid,
// but whose UPDATE waits on a concurrent change of the row and then matches
// nothing, learns from a fresh read what happened instead of guessing.
func TestReleaseRace(t *testing.T) {
	t.Parallel()

	for _, tc := range []struct {
		name string
		// change is what a concurrent transaction does to the lease
		// ($1 key, $2 its token, $3 its owner) while the Release waits.
		change string
		want   func(t *testing.T, err error)
	}{{
		name:   "ForcedRelease",
		change: "UPDATE %s SET held = false, owner = 'operator' WHERE key = $1 AND token = $2 AND $3 <> ''",
		want: func(t *testing.T, err error) {
			le := requireLost(t, err, sqllock.LostReleased)
			require.Equal(t, "operator", le.By)
		},
	}, {
		name:   "OwnReleaseWon",
		change: "UPDATE %s SET held = false, owner = $3 WHERE key = $1 AND token = $2",
		want:   func(t *testing.T, err error) { require.NoError(t, err) },
	}, {
		name:   "TakenOver",
		change: "UPDATE %s SET token = token + 1, owner = 'next', deadline = clock_timestamp() + interval '1 minute' WHERE key = $1 AND token = $2 AND $3 <> ''",
		want: func(t *testing.T, err error) {
			le := requireLost(t, err, sqllock.LostTaken)
			require.NotZero(t, le.Current)
		},
	}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			bundle := newBundle(t, Options{})
			l := acquireOK(t, bundle.backend, "k", "o1", time.Minute)
			tc.want(t, releaseDuring(t, bundle, l, fmt.Sprintf(tc.change, bundle.backend.table), l.Key, l.Token, l.Owner))
		})
	}

	// Re-granted to its owner (a retried acquire) between the UPDATE that
	// lost the race and the fresh read: the Release is sent again and
	// ends the lease.
	t.Run("RegrantedToOwner", func(t *testing.T) {
		bundle := newBundle(t, Options{})
		b := bundle.backend
		l := acquireOK(t, b, "k", "o1", time.Minute)
		regrants := 0
		b.beforeRacePeek = func() {
			regrants++
			if _, err := bundle.db.Pool.Exec(testCtx(t), "UPDATE "+b.table+" SET held = true WHERE key = $1", l.Key); err != nil {
				t.Error(err)
			}
		}
		require.NoError(t, releaseDuring(t, bundle, l, "UPDATE "+b.table+" SET held = false, owner = $2 WHERE key = $1", l.Key, l.Owner))
		require.Equal(t, 1, regrants)
		i := listOne(t, b, "k")
		require.False(t, i.Held, "the lease is still held after Release: %+v", i)
		require.Equal(t, l.Token, i.Token)
	})
}

// TestReleaseJudgedWhenReleased: a Release whose lease is valid when the
// statement starts, but which waits on the row's lock until its deadline
// has passed, reports the lease expired: the lease is judged by the clock
// when the row is released (after the wait), not when the statement began.
func TestReleaseJudgedWhenReleased(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	const ttl = 300 * time.Millisecond
	l := acquireOK(t, bundle.backend, "k", "o1", ttl)
	tx := holdRows(t, bundle.db.Pool, bundle.backend.table, "FOR SHARE", l.Key)
	done := make(chan error, 1)
	go func() { done <- bundle.backend.Release(testCtx(t), l) }()
	blockedBy(t, bundle.db.Pool, tx.Conn().PgConn().PID())
	var passed bool
	require.Eventually(t, func() bool {
		require.NoError(t, bundle.db.Pool.QueryRow(testCtx(t), "SELECT clock_timestamp() > $1", l.Deadline).Scan(&passed))
		return passed
	}, 10*time.Second, 10*time.Millisecond)
	require.NoError(t, tx.Commit(testCtx(t)))
	requireLost(t, <-done, sqllock.LostExpired)
	require.False(t, listOne(t, bundle.backend, "k").Held, "the lease's row is still held after Release")
}

// releaseDuring releases l while a transaction that ran change (on one row)
// holds the row, and commits that transaction once the Release waits on it.
func releaseDuring(t *testing.T, bundle *testBundle, l sqllock.Lease, change string, args ...any) error {
	t.Helper()
	tx, err := bundle.db.Pool.Begin(testCtx(t))
	require.NoError(t, err)
	defer tx.Rollback(testCtx(t))
	tag, err := tx.Exec(testCtx(t), change, args...)
	require.NoError(t, err)
	require.EqualValues(t, 1, tag.RowsAffected())
	done := make(chan error, 1)
	go func() { done <- bundle.backend.Release(testCtx(t), l) }()
	blockedBy(t, bundle.db.Pool, tx.Conn().PgConn().PID())
	require.NoError(t, tx.Commit(testCtx(t)))
	return <-done
}

func requireLost(t *testing.T, err error, want sqllock.LostReason) *sqllock.LostError {
	t.Helper()
	le := lostAs(t, err)
	require.Equal(t, want, le.Reason, "%v", err)
	return le
}

func listOne(t *testing.T, b *Backend, key string) sqllock.LockInfo {
	t.Helper()
	all, err := b.List(testCtx(t), key)
	require.NoError(t, err)
	require.Len(t, all, 1)
	return all[0]
}
