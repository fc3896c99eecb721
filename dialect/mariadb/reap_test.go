package mariadb

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// The races of reaping that no timing makes happen on its own, each held
// open at its dangerous point by the test.

// floorOf reads b's token floor.
func floorOf(t *testing.T, db *sql.DB, b *Backend) int64 {
	t.Helper()
	var f int64
	require.NoError(t, db.QueryRowContext(testCtx(t), "SELECT floor FROM "+renderBare("{{floor}}", b.table, nowSQL)+" WHERE id = 1").Scan(&f))
	return f
}

// endKey acquires and releases key n times and expires it, so that it is
// reapable at once; it returns its last token.
func endKey(t *testing.T, db *sql.DB, b *Backend, key string, n int) int64 {
	t.Helper()
	var l sqllock.Lease
	for i := range n {
		var err error
		l, err = b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: fmt.Sprintf("end-%d", i)})
		require.NoError(t, err)
		require.NoError(t, b.Release(testCtx(t), l))
	}
	expire(t, db, b, key)
	return l.Token
}

// waitUserLock waits until a session other than the caller's waits in
// GET_LOCK while running a statement whose text contains marker.
func waitUserLock(t *testing.T, db *sql.DB, marker string) {
	t.Helper()
	waitFor(t, db, marker, `SELECT COUNT(*) FROM information_schema.PROCESSLIST
		WHERE ID <> CONNECTION_ID() AND DB = DATABASE() AND STATE = 'User lock' AND INSTR(INFO, ?) > 0`)
}

// waitRunning waits until a session other than the caller's runs a
// statement whose text contains marker. The tests use it on a statement
// that a lock they hold makes wait (information_schema.INNODB_TRX does not
// list every waiting transaction: one whose transaction id is not yet
// assigned is missing).
func waitRunning(t *testing.T, db *sql.DB, marker string) {
	t.Helper()
	waitFor(t, db, marker, `SELECT COUNT(*) FROM information_schema.PROCESSLIST
		WHERE ID <> CONNECTION_ID() AND DB = DATABASE() AND COMMAND IN ('Query', 'Execute') AND INSTR(INFO, ?) > 0`)
}

func waitFor(t *testing.T, db *sql.DB, marker, query string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var n int
		require.NoError(t, db.QueryRowContext(testCtx(t), query, marker).Scan(&n))
		if n > 0 {
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Fatalf("no statement with %q came to wait", marker)
}

// A first insert computes its row (the first token, from the floor this
// Backend last read) before it meets a reap: a test-only BEFORE INSERT
// trigger holds an acquire of a key without a row at exactly that point
// (on a GET_LOCK the test holds) while the key is created, used up to
// token 5 and reaped: the stalled statement holds no lock the reap needs
// (the single acquire reads no floor row), so the reap commits, raising
// the floor to 5. Then the acquire goes on with the first token it
// computed (1): migration 00005's check refuses it, the Backend reads the
// floor again and resends. The acquire ends above every token the key
// had, never at the 1 it computed first.
func TestReapWhileAFirstInsertIsOnItsWay(t *testing.T) {
	t.Parallel()
	b, db := newBackend(t)
	_, err := db.ExecContext(testCtx(t), "CREATE TRIGGER stall BEFORE INSERT ON "+quotedTable(b)+
		" FOR EACH ROW BEGIN IF NEW.owner = 'stalled' THEN DO GET_LOCK('stall', 60); END IF; END")
	require.NoError(t, err)
	hold, err := db.Conn(testCtx(t))
	require.NoError(t, err)
	defer hold.Close()
	var got int
	require.NoError(t, hold.QueryRowContext(testCtx(t), "SELECT GET_LOCK('stall', 5)").Scan(&got))
	require.Equal(t, 1, got)

	type result struct {
		l   sqllock.Lease
		err error
	}
	acquired := make(chan result, 1)
	go func() {
		l, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "stalled"})
		acquired <- result{l: l, err: err}
	}()
	waitUserLock(t, db, "GET_LOCK('stall'")

	// Meanwhile the key is created, used to token 5, and a reap picks it.
	last := endKey(t, db, b, "k", 5)
	require.Equal(t, int64(5), last)
	n, err := b.Reap(testCtx(t), 0, 10)
	require.NoError(t, err)
	require.Equal(t, 1, n, "the reap did not take the ended key")

	_, err = hold.ExecContext(testCtx(t), "DO RELEASE_LOCK('stall')")
	require.NoError(t, err)
	r := <-acquired
	require.NoError(t, r.err)
	require.Greater(t, r.l.Token, last, "the stalled first insert got a token the key had: G2")
}

// A reaper's transaction held open after its delete (the floor raised, the
// delete not committed): a first insert of the key waits for it, and once
// it commits gets a token above every one the key had; the same holds
// when the reap rolls back (the key's row comes back, and the acquire goes
// on from its token).
func TestReapNotYetCommitted(t *testing.T) {
	t.Parallel()
	for _, commit := range []bool{true, false} {
		t.Run(fmt.Sprintf("commit=%v", commit), func(t *testing.T) {
			b, db := newBackend(t)
			last := endKey(t, db, b, "k", 3)
			tx, err := db.BeginTx(testCtx(t), &sql.TxOptions{Isolation: sql.LevelReadCommitted})
			require.NoError(t, err)
			defer tx.Rollback()
			_, err = tx.ExecContext(testCtx(t), b.reapMarkSQL)
			require.NoError(t, err)
			res, err := tx.ExecContext(testCtx(t), "DELETE FROM "+quotedTable(b)+" WHERE `key` = 'k'")
			require.NoError(t, err)
			n, err := res.RowsAffected()
			require.NoError(t, err)
			require.Equal(t, int64(1), n)
			_, err = tx.ExecContext(testCtx(t), b.reapUnmarkSQL)
			require.NoError(t, err)

			done := make(chan sqllock.Lease, 1)
			errs := make(chan error, 1)
			go func() {
				l, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "first"})
				done <- l
				errs <- err
			}()
			// The acquire waits on the floor's lock (its read of the
			// floor takes it in share mode).
			waitRunning(t, db, "INSERT INTO")
			if commit {
				require.NoError(t, tx.Commit())
			} else {
				require.NoError(t, tx.Rollback())
			}
			l := <-done
			require.NoError(t, <-errs)
			require.Greater(t, l.Token, last, "a first insert beside a reap got a token the key had: G2")
		})
	}
}

// A row another transaction has locked (a fenced transaction's share
// lock, an acquire in flight) is skipped, not waited for: the reap
// returns at once with the other keys, and the locked one stays.
func TestReapSkipsLockedRows(t *testing.T) {
	t.Parallel()
	b, db := newBackend(t)
	endKey(t, db, b, "locked", 1)
	endKey(t, db, b, "free", 1)
	tx, err := db.BeginTx(testCtx(t), nil)
	require.NoError(t, err)
	defer tx.Rollback()
	var token int64
	require.NoError(t, tx.QueryRowContext(testCtx(t), "SELECT token FROM "+quotedTable(b)+" WHERE `key` = 'locked' LOCK IN SHARE MODE").Scan(&token))

	ctx, cancel := context.WithTimeout(testCtx(t), 3*time.Second)
	defer cancel()
	n, err := b.Reap(ctx, 0, 10)
	require.NoError(t, err, "the reap waited for a locked row")
	require.Equal(t, 1, n)
	require.NoError(t, tx.Rollback())
	i, err := b.List(testCtx(t), "")
	require.NoError(t, err)
	require.Len(t, i, 1)
	require.Equal(t, "locked", i[0].Key)
}

// The floor is raised in the deleting transaction and only by the
// reaper's: an application's DELETE (and REPLACE) is refused, a reap's
// floor is the largest token it deleted, and a later first key starts
// above it.
func TestReapRaisesTheFloor(t *testing.T) {
	t.Parallel()
	b, db := newBackend(t)
	endKey(t, db, b, "a", 2)
	endKey(t, db, b, "b", 4)
	require.Equal(t, int64(0), floorOf(t, db, b))
	n, err := b.Reap(testCtx(t), 0, 10)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	require.Equal(t, int64(4), floorOf(t, db, b))
	l, err := b.TryAcquire(testCtx(t), acq("new"))
	require.NoError(t, err)
	require.Equal(t, int64(5), l.Token, "a new key starts above the floor")
}

// A batch of acquires (group commit) starts its keys without a row above
// the floor too, in the batch itself: reaped keys and a new one, in one
// statement, none sent alone.
func TestGroupCommitFirstRowsAboveTheFloor(t *testing.T) {
	t.Parallel()
	b, db := newBackend(t)
	a := endKey(t, db, b, "a", 3)
	z := endKey(t, db, b, "z", 7)
	n, err := b.Reap(testCtx(t), 0, 10)
	require.NoError(t, err)
	require.Equal(t, 2, n)
	coalesceAlways(b)
	out := acquireBatch(t, b, acq("a"), acq("new"), acq("z"))
	for i, want := range []int64{a, z, z} {
		require.NoError(t, out[i].err)
		require.Greater(t, out[i].l.Token, want, "key %d of the batch: G2", i)
	}
	require.EqualValues(t, 1, b.acquireQ.Batches(), "the acquires went as one batch")
	require.Zero(t, b.acquireQ.Alone(), "a member was sent alone")
}

// The reaper's mark on the floor row is gone once its transaction
// commits: a DELETE on the same connection afterwards (one connection in
// the pool) is refused, and the floor row says no reaper.
func TestReapLeavesNoMark(t *testing.T) {
	t.Parallel()
	b, db := newBackend(t)
	db.SetMaxOpenConns(1)
	endKey(t, db, b, "a", 1)
	endKey(t, db, b, "b", 1)
	n, err := b.Reap(testCtx(t), 0, 1)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	_, err = db.ExecContext(testCtx(t), "DELETE FROM "+quotedTable(b))
	require.ErrorContains(t, err, "never deleted")
	var reaper int64
	require.NoError(t, db.QueryRowContext(testCtx(t), "SELECT reaper FROM "+renderBare("{{floor}}", b.table, nowSQL)).Scan(&reaper))
	require.Zero(t, reaper)
}

// A first row that migration 00005's check refuses (SQLSTATE 40001: at or
// below the floor) applied nothing and is sent again, and the resend
// reads the floor. A test-only trigger (its count in a MEMORY table,
// which no rollback undoes) lowers the first attempt's token to 1, as a
// statement that read the floor before a reap committed would have it.
func TestFirstRowRefusedByTheFloorIsSentAgain(t *testing.T) {
	t.Parallel()
	b, db := newBackend(t)
	last := endKey(t, db, b, "gone", 4)
	n, err := b.Reap(testCtx(t), 0, 10)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	for _, q := range []string{
		"CREATE TABLE shots (n INT) ENGINE = MEMORY",
		"CREATE TRIGGER stale BEFORE INSERT ON " + quotedTable(b) + " FOR EACH ROW BEGIN " +
			"IF NEW.owner = 'stale' AND (SELECT COUNT(*) FROM shots) = 0 THEN INSERT INTO shots VALUES (1); SET NEW.token = 1; END IF; END",
	} {
		_, err := db.ExecContext(testCtx(t), q)
		require.NoError(t, err, q)
	}
	l, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "gone", TTL: time.Minute, Owner: "stale"})
	require.NoError(t, err)
	require.Greater(t, l.Token, last)
	var shots int
	require.NoError(t, db.QueryRowContext(testCtx(t), "SELECT COUNT(*) FROM shots").Scan(&shots))
	require.Equal(t, 1, shots, "the first attempt did not go through the stale token")
}
