package postgres

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// waitedOf reads key's "waited" mark (migration 00003).
func waitedOf(t *testing.T, b *Backend, key string) bool {
	t.Helper()
	var w bool
	require.NoError(t, b.pool.QueryRow(testCtx(t), "SELECT waited FROM "+b.table+" WHERE key = $1", key).Scan(&w))
	return w
}

// TestWaiterMarksOncePerTenure: while a key is watched, the first refused
// attempt of a tenure marks it (one write, committed asynchronously), and
// the next ones write nothing, like an unwatched refused attempt; a same
// owner's repeat keeps the mark, and a new tenure starts without it.
func TestWaiterMarksOncePerTenure(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	holder := acquireOK(t, b, "hot", "holder", time.Hour)

	// attempts runs n watched attempts in a transaction and returns its
	// transaction id (nil: nothing written) and synchronous_commit.
	attempts := func(n int, holder string) (xid *int64, syncCommit string) {
		tx, err := bundle.db.Pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx)
		for range n {
			// What TryAcquire sends while the key is watched.
			r := txAcquire(t, tx, b.full.acquireWait, sqllock.AcquireRequest{Key: "hot", TTL: time.Minute, Owner: "waiter"})
			require.False(t, r.granted)
			require.False(t, r.changed)
			require.Equal(t, holder, r.owner)
			require.True(t, r.held && r.deadline.After(r.now), "refused for a live lease")
		}
		require.NoError(t, tx.QueryRow(ctx, "SELECT pg_current_xact_id_if_assigned()::text::bigint, current_setting('synchronous_commit')").Scan(&xid, &syncCommit))
		require.NoError(t, tx.Commit(ctx))
		return xid, syncCommit
	}

	require.False(t, waitedOf(t, b, "hot"))
	xid, syncCommit := attempts(1, "holder")
	require.NotNil(t, xid, "the first watched attempt of a tenure marks the lease")
	require.Equal(t, "off", syncCommit, "a mark commits asynchronously")
	require.True(t, waitedOf(t, b, "hot"))
	xid, _ = attempts(10, "holder")
	require.Nil(t, xid, "a watched attempt on a marked lease wrote")
	walRecords, _ := planWAL(t, b, b.full.acquireWait, "hot", int64(60_000_000), "waiter", nil, int64(0))
	require.Zero(t, walRecords, "a watched attempt on a marked lease wrote WAL")

	// A repeat of the holder's own acquire keeps the tenure and its mark.
	again := acquireOK(t, b, "hot", "holder", time.Hour)
	require.Equal(t, holder.Token, again.Token)
	require.True(t, waitedOf(t, b, "hot"), "a same-owner repeat dropped the mark")
	// A grant of a new tenure starts unmarked, and is marked once again.
	require.NoError(t, b.Release(ctx, again))
	next := acquireOK(t, b, "hot", "holder2", time.Hour)
	require.Equal(t, holder.Token+1, next.Token)
	require.False(t, waitedOf(t, b, "hot"), "a new tenure inherited the mark")
	xid, _ = attempts(3, "holder2")
	require.NotNil(t, xid)
	require.True(t, waitedOf(t, b, "hot"))

	// Unwatched, an attempt never marks: a TryAcquire that does not wait
	// writes nothing.
	require.False(t, b.watched("hot"))
	require.NoError(t, b.Release(ctx, next))
	acquireOK(t, b, "hot", "holder3", time.Hour)
	_, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "hot", TTL: time.Minute, Owner: "w"})
	require.ErrorIs(t, err, sqllock.ErrNotAcquired)
	require.False(t, waitedOf(t, b, "hot"))
}

// TestMarkNeverWaitsOnRowLock: a watched attempt on a row that another
// transaction holds locked (a fenced transaction's FOR SHARE, or a release
// in flight) neither waits nor marks; it reports a refusal without details,
// so that the waiter tries again soon. Once the lock is gone it marks, or,
// after the release, it is granted.
func TestMarkNeverWaitsOnRowLock(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	_, stop := b.Watch("k")
	defer stop()
	l := acquireOK(t, b, "k", "holder", time.Hour)

	quickRefusal := func(what string) {
		t.Helper()
		actx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		start := time.Now()
		_, err := b.TryAcquire(actx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "waiter"})
		var he *sqllock.HeldError
		require.ErrorAs(t, err, &he, what)
		require.Empty(t, he.Owner, "%s: a refusal whose mark did not apply has no details", what)
		require.Zero(t, he.Remaining, what)
		require.Less(t, time.Since(start), 2*time.Second, "%s: the attempt waited on the row lock", what)
		require.False(t, waitedOf(t, b, "k"), what)
	}

	err := b.FencedTx(ctx, l, func(pgx.Tx) error {
		quickRefusal("during a fenced transaction")
		return nil
	})
	require.NoError(t, err)
	waiting(t, b, "k")
	require.True(t, waitedOf(t, b, "k"))

	// A release in flight (its row lock held, not committed yet).
	l2 := acquireOK(t, b, "k2", "holder", time.Hour)
	_, stop2 := b.Watch("k2")
	defer stop2()
	tx, err := bundle.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	require.True(t, txRelease(t, tx, b, l2))
	actx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	_, err = b.TryAcquire(actx, sqllock.AcquireRequest{Key: "k2", TTL: time.Minute, Owner: "waiter"})
	var he *sqllock.HeldError
	require.ErrorAs(t, err, &he)
	require.Empty(t, he.Owner, "the mark met a release in flight: try again soon")
	require.NoError(t, tx.Commit(ctx))
	got := acquireOK(t, b, "k2", "waiter", time.Minute)
	require.Equal(t, l2.Token+1, got.Token)
}

// TestReleaseNotifiesOnlyWhenWaited listens on the table's channel itself:
// a release of an unmarked lease sends nothing, a marked one notifies.
func TestReleaseNotifiesOnlyWhenWaited(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{DurableRelease: true})
	b := bundle.backend
	ctx := testCtx(t)
	conn, err := bundle.db.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	var channel string
	require.NoError(t, conn.QueryRow(ctx, b.full.channel).Scan(&channel))
	_, err = conn.Exec(ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize())
	require.NoError(t, err)
	defer conn.Exec(context.Background(), "UNLISTEN *")

	quiet := acquireOK(t, b, "quiet", "o", time.Minute)
	require.NoError(t, b.Release(ctx, quiet))
	_, stop := b.Watch("loud")
	defer stop()
	loud := acquireOK(t, b, "loud", "o", time.Minute)
	waiting(t, b, "loud")
	require.NoError(t, b.Release(ctx, loud))
	// Notifications arrive in commit order: "quiet" would come first.
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	n, err := conn.Conn().WaitForNotification(wctx)
	require.NoError(t, err)
	require.Equal(t, "loud", n.Payload, "a release nobody waited for notified")
}

// TestUpgradeFromVersion2: a table at migration 00002 with held leases.
// Before 00003 a Backend works with its legacy statements (no mark; every
// release notifies); after it, the leases are intact (held, with their
// tokens, their holders reported, released by their tokens, the next grant
// continues above them), the old Backend keeps working, and a new one
// marks.
func TestUpgradeFromVersion2(t *testing.T) {
	t.Parallel()
	db, upgrade := schemaAt(t, 2)
	ctx := testCtx(t)
	// Leases as a Backend before 00003 left them.
	_, err := db.Pool.Exec(ctx, `INSERT INTO sqllock_locks (key, token, held, deadline, owner) VALUES
		('a', 7, true, clock_timestamp() + interval '1 hour', 'old-a'),
		('b', 3, true, clock_timestamp() + interval '1 hour', 'old-b'),
		('c', 9, false, clock_timestamp(), 'old-c'),
		('d', 4, true, clock_timestamp() + interval '1 hour', 'old-d')`)
	require.NoError(t, err)

	old, err := New(db.Pool, Options{})
	require.NoError(t, err)
	defer old.Close()
	ch, stop := old.Watch("d")
	defer stop()
	listening(t, old, ch)
	_, err = old.TryAcquire(ctx, sqllock.AcquireRequest{Key: "d", TTL: time.Minute, Owner: "new"})
	var he *sqllock.HeldError
	require.ErrorAs(t, err, &he)
	require.Equal(t, "old-d", he.Owner)
	require.True(t, !old.stmts.Load().waited, "the Backend fell back to its legacy statements")
	// Legacy: a release notifies, though nobody could mark it.
	require.NoError(t, old.Release(ctx, sqllock.Lease{Key: "d", Token: 4, Owner: "old-d"}))
	wakeWithin(t, ch, 10*time.Second, "a legacy release")
	d := acquireOK(t, old, "d", "new", time.Minute)
	require.EqualValues(t, 5, d.Token)

	upgrade()
	d2 := acquireOK(t, old, "c", "new", time.Minute) // the old Backend still works
	require.EqualValues(t, 10, d2.Token)

	b, err := New(db.Pool, Options{})
	require.NoError(t, err)
	defer b.Close()
	_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "a", TTL: time.Minute, Owner: "new"})
	require.ErrorAs(t, err, &he)
	require.Equal(t, "old-a", he.Owner)
	require.EqualValues(t, 7, he.Token)
	require.Positive(t, he.Remaining)
	require.True(t, b.stmts.Load().waited)

	// A waiter marks the upgraded lease, and its release notifies.
	ch, stop = b.Watch("a")
	defer stop()
	listening(t, b, ch)
	waiting(t, b, "a")
	require.True(t, waitedOf(t, b, "a"))
	require.NoError(t, b.Release(ctx, sqllock.Lease{Key: "a", Token: 7, Owner: "old-a"}))
	wakeWithin(t, ch, 10*time.Second, "release of an upgraded lease")

	got := acquireOK(t, b, "a", "new", time.Minute)
	require.EqualValues(t, 8, got.Token)
	_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "b", TTL: time.Minute, Owner: "new"})
	require.True(t, errors.As(err, &he) && he.Token == 3 && he.Owner == "old-b", "%v", err)
}
