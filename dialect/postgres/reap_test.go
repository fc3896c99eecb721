package postgres

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// The races of reaping that no timing makes happen on its own, each held
// open at its dangerous point with a transaction of the test's own.

// floorOf reads b's token floor.
func floorOf(t *testing.T, b *Backend) int64 {
	t.Helper()
	var f int64
	require.NoError(t, adminPool(b).QueryRow(testCtx(t), `SELECT last_value FROM `+schema{Table: b.table}.Floor()).Scan(&f))
	return f
}

// endKey acquires and releases key n times and expires it, so that it is
// reapable at once; it returns its last token.
func endKey(t *testing.T, b *Backend, key string, n int) int64 {
	t.Helper()
	var l sqllock.Lease
	for i := range n {
		l = acquireOK(t, b, key, fmt.Sprintf("end-%d", i), time.Minute)
		require.NoError(t, b.Release(testCtx(t), l))
	}
	expire(t, b, key)
	return l.Token
}

// waitBlocked waits until some session other than the test's waits on a
// lock (a row's or an advisory one) while running a statement that
// contains marker.
func waitBlocked(t *testing.T, b *Backend, marker string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var n int
		require.NoError(t, adminPool(b).QueryRow(testCtx(t), `SELECT count(*) FROM pg_stat_activity
			WHERE wait_event_type = 'Lock' AND pid <> pg_backend_pid() AND strpos(query, $1) > 0`, marker).Scan(&n))
		if n > 0 {
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Fatalf("no statement with %q came to wait on a lock", marker)
}

// An INSERT computes its row (the first token, floor + 1) before it waits
// on a conflicting row, and a reap may delete that key's newer history and
// raise the floor meanwhile. A test-only BEFORE INSERT trigger holds the
// acquire between the two (where, in production, the wait on a
// conflicting insert holds it) while the key is created, used up to token
// 5 and reaped; then the acquire goes on: its first try's token 1 is
// refused after the insert by migration 00006's check, and its resend
// reads the floor again. Without the check it would be granted token 1
// behind a key that had 5.
func TestReapWhileAFirstInsertIsOnItsWay(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	admin := adminPool(b)
	_, err := admin.Exec(testCtx(t), `CREATE FUNCTION stall() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_advisory_xact_lock(4242); RETURN NEW; END $$;
		CREATE TRIGGER stall BEFORE INSERT ON `+b.table+` FOR EACH ROW WHEN (NEW.owner = 'stalled') EXECUTE FUNCTION stall()`)
	require.NoError(t, err)
	hold, err := admin.Begin(testCtx(t))
	require.NoError(t, err)
	defer hold.Rollback(context.Background())
	_, err = hold.Exec(testCtx(t), `SELECT pg_advisory_xact_lock(4242)`)
	require.NoError(t, err)

	type result struct {
		l   sqllock.Lease
		err error
	}
	done := make(chan result, 1)
	go func() {
		l, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "stalled"})
		done <- result{l, err}
	}()
	waitBlocked(t, b, "WITH upd AS (")

	last := endKey(t, b, "k", 5)
	n, err := b.Reap(testCtx(t), 0, 10)
	require.NoError(t, err)
	require.Equal(t, 1, n)
	require.GreaterOrEqual(t, floorOf(t, b), last)

	require.NoError(t, hold.Commit(testCtx(t)))
	r := <-done
	require.NoError(t, r.err)
	require.Greater(t, r.l.Token, last, "the first insert that was on its way when the key was reaped: G2")
}

// A reaper's transaction that has deleted a key (and so raised the floor)
// but not committed: an acquire of the key waits for the row (its
// statement's snapshot still has it), then is refused or granted above
// every token the key had, never below; after the commit the key starts
// above them too. A TRUNCATE, and a DELETE without the reaper's setting,
// are refused all along.
func TestReapNotYetCommitted(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	admin := adminPool(b)
	last := endKey(t, b, "k", 4)
	acquireOK(t, b, "held", "h", time.Minute)

	for _, stmt := range []string{`DELETE FROM ` + b.table, `DELETE FROM ` + b.table + ` WHERE key = 'k'`, `TRUNCATE ` + b.table} {
		_, err := admin.Exec(testCtx(t), stmt)
		require.ErrorContains(t, err, "never deleted", stmt)
	}

	reaper, err := admin.Begin(testCtx(t))
	require.NoError(t, err)
	defer reaper.Rollback(context.Background())
	tag, err := reaper.Exec(testCtx(t), fmt.Sprintf(`DELETE FROM %s WHERE key = 'k'
		AND set_config('sqllock.reap', '%s'::regclass::oid::text, true) IS NOT NULL`, b.table, b.table))
	require.NoError(t, err)
	require.EqualValues(t, 1, tag.RowsAffected())
	require.GreaterOrEqual(t, floorOf(t, b), last, "the floor rises before the delete commits")

	type result struct {
		l   sqllock.Lease
		err error
	}
	done := make(chan result, 1)
	go func() {
		l, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "racer"})
		done <- result{l, err}
	}()
	waitBlocked(t, b, "WITH upd AS (")
	// A first row of another key meanwhile starts above the raised floor.
	fresh := acquireOK(t, b, "fresh", "f", time.Minute)
	require.Greater(t, fresh.Token, last)

	require.NoError(t, reaper.Commit(testCtx(t)))
	r := <-done
	if r.err == nil {
		require.Greater(t, r.l.Token, last, "granted while the reap committed: G2")
	} else {
		require.True(t, errors.Is(r.err, sqllock.ErrNotAcquired) || errors.Is(r.err, sqllock.ErrUnavailable), "%v", r.err)
		l := acquireOK(t, b, "k", "after", time.Minute)
		require.Greater(t, l.Token, last, "the key after the reap: G2")
	}
}

// A row that a fenced transaction holds (FOR SHARE, as fence.sql locks
// it) is skipped by a reap, without waiting, even once its lease expired;
// once the transaction ends, the next reap takes it.
func TestReapSkipsAFencedRow(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	admin := adminPool(b)
	endKey(t, b, "k", 1)
	endKey(t, b, "other", 1)
	fenced, err := admin.Begin(testCtx(t))
	require.NoError(t, err)
	defer fenced.Rollback(context.Background())
	var one int
	require.NoError(t, fenced.QueryRow(testCtx(t), `SELECT 1 FROM `+b.table+` WHERE key = 'k' FOR SHARE`).Scan(&one))

	ctx, cancel := context.WithTimeout(testCtx(t), 5*time.Second)
	defer cancel()
	n, err := b.Reap(ctx, 0, 10)
	require.NoError(t, err, "a reap never waits for a locked row")
	require.Equal(t, 1, n, "only the row nobody locked")
	var left []string
	rows, err := admin.Query(testCtx(t), `SELECT key FROM `+b.table)
	require.NoError(t, err)
	left, err = pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"k"}, left)

	require.NoError(t, fenced.Commit(testCtx(t)))
	n, err = b.Reap(testCtx(t), 0, 10)
	require.NoError(t, err)
	require.Equal(t, 1, n)
}

// The reap's statement and the floor work on every acquire form: a batch
// (group commit) and a set of keys insert first rows above the floor.
func TestReapFloorInEveryInsert(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	var last int64
	for _, k := range []string{"a", "b", "c"} {
		last = max(last, endKey(t, b, k, 3))
	}
	n, err := b.Reap(testCtx(t), 0, 10)
	require.NoError(t, err)
	require.Equal(t, 3, n)

	ls, err := b.TryAcquireAll(testCtx(t), sqllock.MultiAcquireRequest{Keys: []string{"a", "b"}, TTL: time.Minute, Owner: "set"})
	require.NoError(t, err)
	for _, l := range ls {
		require.Greater(t, l.Token, last, "a key of a set after its reap: %s", l.Key)
	}
	st, err := b.statements(testCtx(t), "test", "")
	require.NoError(t, err)
	var granted bool
	var token int64
	rows, err := adminPool(b).Query(testCtx(t), st.acquireBatch, []string{"c"}, []int64{60_000_000}, []string{"batch"}, [][]byte{nil}, []int64{0})
	require.NoError(t, err)
	for rows.Next() {
		vals, err := rows.Values()
		require.NoError(t, err)
		granted, token = vals[1].(bool), vals[2].(int64)
	}
	require.NoError(t, rows.Err())
	require.True(t, granted)
	require.Greater(t, token, last, "a first row from the batch statement after its key's reap")
}

// A table at 00005 whose leases a Backend of that version holds (one held,
// one ended) is upgraded by 00006 while they are held: no row changes,
// the held lease renews (through either Backend) and is never reaped; the
// ended key is reaped and granted again above its tokens by a new
// Backend; the old Backend's statements (version 5's: a first row takes
// token 1) then fail closed for a key without a row, the reaped one or a
// new one, while its leases of keys with rows keep working; and the old
// Backend cannot reap.
func TestUpgradeToReapingKeepsLeases(t *testing.T) {
	t.Parallel()
	db, upgrade := schemaAt(t, 5)
	old, err := New(db.Pool, Options{})
	require.NoError(t, err)
	defer old.Close()
	ctx := testCtx(t)
	held := acquireOK(t, old, "held", "old-h", time.Hour)
	last := endKey(t, old, "ended", 3)
	rows := func() [][]any {
		r, err := db.Pool.Query(ctx, `SELECT key, token, held, deadline, owner FROM `+old.table+` ORDER BY key`)
		require.NoError(t, err)
		out, err := pgx.CollectRows(r, func(row pgx.CollectableRow) ([]any, error) { return row.Values() })
		require.NoError(t, err)
		return out
	}
	before := rows()

	upgrade()
	require.Equal(t, before, rows(), "the migration changed a lease")
	b, err := New(db.Pool, Options{})
	require.NoError(t, err)
	defer b.Close()
	require.Zero(t, floorOf(t, b), "no row was ever deleted before 00006")
	_, err = b.TryRenew(ctx, held, time.Hour)
	require.NoError(t, err, "the lease held across the upgrade renews (new Backend)")
	_, err = old.TryRenew(ctx, held, time.Hour)
	require.NoError(t, err, "the lease held across the upgrade renews (old Backend)")

	_, err = old.Reap(ctx, 0, 10)
	require.ErrorIs(t, err, sqllock.ErrSchemaMissing, "a Backend that read version 5 does not reap")
	n, err := b.Reap(ctx, 0, 10)
	require.NoError(t, err)
	require.Equal(t, 1, n, "the ended key, never the held one")

	for _, key := range []string{"ended", "brand-new"} {
		_, err := old.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: "old-late"})
		require.Error(t, err, "the old statement's first row of %q (token 1) after a reap", key)
		require.NotErrorIs(t, err, sqllock.ErrNotAcquired, "%q: failed closed, not refused as held", key)
	}
	require.Len(t, rows(), 1, "the refused first rows left nothing")
	require.NoError(t, old.Release(ctx, held))
	again := acquireOK(t, old, "held", "old-again", time.Minute)
	require.Equal(t, held.Token+1, again.Token, "the old Backend's keys with rows keep working")

	l := acquireOK(t, b, "ended", "new", time.Minute)
	require.Greater(t, l.Token, last, "a reaped key continues above every token it had")
}

// Two reapers at once: each one's row trigger reads the floor and raises
// it past its row's token, and without an order between them the one
// that read first could set its smaller token last, lowering the floor
// below a token the other just reaped. Migration 00006 takes an advisory
// lock (per table, held to the end of the transaction) around that read
// and raise. The test holds the reaper of a key at token 5 between its
// read (floor 0) and its raise: a shim of setval, first on that
// session's search_path, waits for an advisory lock the test holds. A
// second reaper deletes a key at token 10 meanwhile: it waits for the
// first one's lock (without it, it raises the floor to 10 and commits).
// Once the first goes on, the floor must end at 10, and the key reaped at
// 10 starts above it.
func TestConcurrentReapersNeverLowerTheFloor(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	admin := adminPool(b)
	hi := endKey(t, b, "hi", 10)
	lo := endKey(t, b, "lo", 5)
	require.EqualValues(t, 10, hi)
	require.EqualValues(t, 5, lo)

	shim := pgx.Identifier{bundle.db.Schema + "_shim"}.Sanitize()
	gate := time.Now().UnixNano() & 0x7fffffff
	_, err := admin.Exec(testCtx(t), `CREATE SCHEMA `+shim)
	require.NoError(t, err)
	t.Cleanup(func() { _, _ = admin.Exec(context.Background(), `DROP SCHEMA `+shim+` CASCADE`) })
	_, err = admin.Exec(testCtx(t), fmt.Sprintf(`CREATE FUNCTION %s.setval(regclass, bigint) RETURNS bigint LANGUAGE plpgsql AS $$
		BEGIN
			IF $2 = 5 THEN PERFORM pg_advisory_xact_lock_shared(%d); END IF;
			RETURN pg_catalog.setval($1, $2);
		END $$`, shim, gate))
	require.NoError(t, err)

	hold, err := admin.Acquire(testCtx(t))
	require.NoError(t, err)
	defer hold.Release()
	_, err = hold.Exec(testCtx(t), `SELECT pg_advisory_lock($1)`, gate)
	require.NoError(t, err)
	unlocked := false
	defer func() {
		if !unlocked {
			_, _ = hold.Exec(context.Background(), `SELECT pg_advisory_unlock($1)`, gate)
		}
	}()

	// reapKey deletes key as the reaper does, on a connection whose
	// search_path puts the shim before pg_catalog.
	reapKey := func(key string) error {
		tx, err := admin.Begin(testCtx(t))
		if err != nil {
			return err
		}
		defer tx.Rollback(context.Background())
		if _, err := tx.Exec(testCtx(t), fmt.Sprintf(`SET LOCAL search_path = %s, pg_catalog, %s`, shim, pgx.Identifier{bundle.db.Schema}.Sanitize())); err != nil {
			return err
		}
		if _, err := tx.Exec(testCtx(t), fmt.Sprintf(`DELETE FROM %s WHERE key = $1 /* reaper-%s */
			AND set_config('sqllock.reap', '%s'::regclass::oid::text, true) IS NOT NULL`, b.table, key, b.table), key); err != nil {
			return err
		}
		return tx.Commit(testCtx(t))
	}
	first := make(chan error, 1)
	go func() { first <- reapKey("lo") }()
	waitBlocked(t, b, "reaper-lo")

	second := make(chan error, 1)
	go func() { second <- reapKey("hi") }()
	// The second reaper either waits for the first one's lock or, without
	// it, commits its raise to 10.
	deadline := time.Now().Add(10 * time.Second)
	for waiting := false; !waiting; {
		select {
		case err := <-second:
			require.NoError(t, err)
			second <- nil
			waiting = true
		default:
			var n int
			require.NoError(t, admin.QueryRow(testCtx(t), `SELECT count(*) FROM pg_stat_activity
				WHERE wait_event_type = 'Lock' AND strpos(query, 'reaper-hi') > 0`).Scan(&n))
			waiting = n > 0
			require.True(t, time.Now().Before(deadline), "the second reaper neither waited nor finished")
			time.Sleep(2 * time.Millisecond)
		}
	}
	_, err = hold.Exec(testCtx(t), `SELECT pg_advisory_unlock($1)`, gate)
	require.NoError(t, err)
	unlocked = true
	require.NoError(t, <-first)
	require.NoError(t, <-second)

	require.EqualValues(t, hi, floorOf(t, b), "two reapers lowered the floor below a reaped token")
	l := acquireOK(t, b, "hi", "again", time.Minute)
	require.Greater(t, l.Token, hi, "the key reaped at 10 started again below it: G2")
}
