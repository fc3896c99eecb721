package postgres

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// slowFirstCommit makes every transaction that inserts a row into b's table
// take d to commit, after the row is written and before the commit is
// acknowledged, like a slow fsync or a slow synchronous standby: a deferred
// constraint trigger sleeps at commit, and, like a commit that has reached
// its WAL flush, it cannot be cancelled (pgx sends a cancel request when a
// context ends in flight; the trigger sleeps on through it).
func slowFirstCommit(t *testing.T, b *Backend, d time.Duration) {
	t.Helper()
	_, err := b.pool.Exec(testCtx(t), `
CREATE FUNCTION slow_commit() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    until timestamptz := clock_timestamp() + interval '`+strconv.FormatInt(d.Microseconds(), 10)+` microseconds';
BEGIN
    WHILE clock_timestamp() < until LOOP
        BEGIN
            PERFORM pg_sleep(extract(epoch FROM until - clock_timestamp()));
        EXCEPTION WHEN query_canceled THEN
            NULL;
        END;
    END LOOP;
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER slow_commit AFTER INSERT ON `+b.table+`
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION slow_commit();`)
	require.NoError(t, err)
}

// TestRepeatOfSlowFirstAcquire (G6): the first acquire of a new key is
// applied but its commit is slow, and the caller's context ends first. The
// repeat of the same request waits for that insert and must get the grant
// back (same token), not be told the key is held by someone it cannot name.
func TestRepeatOfSlowFirstAcquire(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	slowFirstCommit(t, b, 600*time.Millisecond)

	req := sqllock.AcquireRequest{Key: "first", TTL: time.Minute, Owner: "o/1"}
	ctx, cancel := context.WithTimeout(testCtx(t), 150*time.Millisecond)
	defer cancel()
	_, err := b.TryAcquire(ctx, req)
	require.ErrorIs(t, err, sqllock.ErrIndeterminate, "the context ends while the commit sleeps")

	l, err := b.TryAcquire(testCtx(t), req)
	require.NoError(t, err, "the repeat of an applied first acquire gets its grant back")
	require.EqualValues(t, 1, l.Token)
	require.Equal(t, req.Owner, l.Owner)

	// Another owner is still refused, and told who holds the key.
	_, err = b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "first", TTL: time.Minute, Owner: "o/2"})
	var he *sqllock.HeldError
	require.ErrorAs(t, err, &he)
	require.Equal(t, req.Owner, he.Owner)
}

// TestClientSettlesSlowFirstAcquire (G6) is the same with the real Client:
// TryAcquire's context ends during the slow commit of the first grant of a
// key. The caller must end up holding the lease, or with an error that is
// not "held by someone else" and no grant left in its name: an orphan would
// hold the key for its whole TTL with nobody to release it.
func TestClientSettlesSlowFirstAcquire(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	slowFirstCommit(t, b, 600*time.Millisecond)
	c, err := sqllock.New(b, sqllock.Options{TTL: time.Minute})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, c.Close(testCtx(t))) })

	ctx, cancel := context.WithTimeout(testCtx(t), 150*time.Millisecond)
	defer cancel()
	g, err := c.TryAcquire(ctx, "first", nil)
	if err == nil {
		require.NoError(t, g.Release(testCtx(t)))
		return
	}
	require.NotErrorIs(t, err, sqllock.ErrNotAcquired, "the caller was told the key is held by another: %v", err)
	require.True(t, errors.Is(err, sqllock.ErrIndeterminate) || errors.Is(err, context.DeadlineExceeded), "%v", err)

	var (
		held  bool
		owner string
	)
	require.NoError(t, b.pool.QueryRow(testCtx(t), "SELECT held, owner FROM "+b.table+" WHERE key = 'first'").Scan(&held, &owner))
	require.False(t, held && strings.HasPrefix(owner, c.Owner()+"/"), "an orphan grant holds the key for the caller (owner %q)", owner)
}

// TestDeadlineNeverMovesBack: a renewal that waited on a row lock read its
// clock before the wait; when another renewal of the same lease committed a
// later deadline meanwhile, the waiting one must not move it back (G3: the
// guard's local deadline counts from the later renewal's send time).
func TestDeadlineNeverMovesBack(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	l := acquireOK(t, b, "k", "o", time.Minute)

	// A transaction holds the row, as a concurrent writer would.
	tx, err := bundle.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	_, err = tx.Exec(ctx, "SELECT FROM "+b.table+" WHERE key = 'k' FOR UPDATE")
	require.NoError(t, err)

	// R1 reads its clock now, then waits for the row.
	r1 := make(chan error, 1)
	go func() {
		_, err := b.TryRenew(ctx, l, time.Minute)
		r1 <- err
	}()
	require.Eventually(t, func() bool {
		var n int
		err := b.pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()").Scan(&n)
		return err == nil && n > 0
	}, 10*time.Second, 5*time.Millisecond, "R1 never waited for the row")
	time.Sleep(300 * time.Millisecond)

	// R2, inside the transaction, renews later and commits first.
	renewed, l2Deadline := txRenew(t, tx, b, l, time.Minute)
	require.True(t, renewed)
	require.NoError(t, tx.Commit(ctx))
	require.NoError(t, <-r1)

	var deadline time.Time
	require.NoError(t, b.pool.QueryRow(ctx, "SELECT deadline FROM "+b.table+" WHERE key = 'k'").Scan(&deadline))
	require.False(t, deadline.Before(l2Deadline), "the deadline moved back from %v to %v", l2Deadline, deadline)
}
