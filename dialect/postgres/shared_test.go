package postgres

import (
	"context"
	"database/sql"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// The races of shared locks that no timing makes happen on its own, each
// held open at its dangerous point by a test-only trigger that waits on
// an advisory lock the test holds.

// stallSlotInserts makes the shared acquire of owner "stalled" wait, once
// it has locked (and written) K's row, on advisory lock key (one per test:
// the tests' schemas share a database, and so its advisory locks), which
// the test holds until it calls the returned function.
func stallSlotInserts(t *testing.T, b *Backend, key int64) (release func()) {
	t.Helper()
	admin := adminPool(b)
	_, err := admin.Exec(testCtx(t), fmt.Sprintf(`CREATE FUNCTION stall_slot() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_advisory_xact_lock(%d); RETURN NEW; END $$;
		CREATE TRIGGER stall_slot BEFORE INSERT ON `+b.table+` FOR EACH ROW WHEN (NEW.owner = 'stalled') EXECUTE FUNCTION stall_slot()`, key))
	require.NoError(t, err)
	hold, err := admin.Begin(testCtx(t))
	require.NoError(t, err)
	t.Cleanup(func() { hold.Rollback(context.Background()) })
	_, err = hold.Exec(testCtx(t), `SELECT pg_advisory_xact_lock($1)`, key)
	require.NoError(t, err)
	return func() { require.NoError(t, hold.Commit(testCtx(t))) }
}

// waitStalled waits until a session waits on advisory lock key and
// returns its pid.
func waitStalled(t *testing.T, b *Backend, key int64) int {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var pids []int
		require.NoError(t, adminPool(b).QueryRow(testCtx(t), `SELECT coalesce(array_agg(pid), '{}') FROM pg_locks
			WHERE locktype = 'advisory' AND NOT granted AND ((classid::bigint << 32) | objid::bigint) = $1`, key).Scan(&pids))
		if len(pids) == 1 {
			return pids[0]
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Fatalf("no statement came to wait on advisory lock %d", key)
	return 0
}

// waitBlockedBy waits until n sessions wait on a lock that session pid
// holds.
func waitBlockedBy(t *testing.T, b *Backend, pid, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		var got int
		require.NoError(t, adminPool(b).QueryRow(testCtx(t), `SELECT count(*) FROM pg_stat_activity
			WHERE $1::int = ANY(pg_blocking_pids(pid))`, pid).Scan(&got))
		if got >= n {
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
	t.Fatalf("fewer than %d statements came to wait on session %d", n, pid)
}

type sharedResult struct {
	l   sqllock.Lease
	err error
}

func goTry(t *testing.T, b *Backend, req sqllock.AcquireRequest) <-chan sharedResult {
	done := make(chan sharedResult, 1)
	go func() {
		l, err := b.TryAcquire(testCtx(t), req)
		done <- sharedResult{l, err}
	}()
	return done
}

// Two readers take a slot of one key that a third reads at once: the
// first ("stalled") has locked K's row and waits before its slot's
// insert; the second's snapshot sees slot 2 free, as the first's did, and
// it waits for K's row. Once the first commits, the second must not take
// slot 2 too, nor count a reader it did not grant: K's row moved to the
// first's token, so the second reads again and takes slot 3.
func TestSharedReadersRaceForOneSlot(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	r0, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "r0", Shared: true})
	require.NoError(t, err)
	go1 := stallSlotInserts(t, b, 7245291000000004343)
	first := goTry(t, b, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "stalled", Shared: true})
	pid := waitStalled(t, b, 7245291000000004343)
	second := goTry(t, b, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "second", Shared: true})
	waitBlockedBy(t, b, pid, 1)
	go1()
	r1, r2 := <-first, <-second
	require.NoError(t, r1.err)
	require.NoError(t, r2.err)
	require.NotEqual(t, r1.l.Key, r2.l.Key, "two readers granted one slot")
	require.Greater(t, r2.l.Token, r1.l.Token)
	all, err := b.List(testCtx(t), "k")
	require.NoError(t, err)
	require.Equal(t, "k", all[0].Key)
	require.Equal(t, 3, all[0].Shared, "readers counted on K: %+v", all)
	for _, r := range []sqllock.Lease{r0, r1.l, r2.l} {
		require.NoError(t, b.Release(testCtx(t), r))
	}
	acquireOK(t, b, "k", "w", time.Minute) // the count reached 0: K is free
}

// A writer waits for K's row while a first reader, which locked it, is on
// its way to its slot: the writer's snapshot saw K free, its UPDATE checks
// K's newest row, held by the reader, and refuses (a raced refusal to try
// again at once); its next attempt names the reader.
func TestSharedWriterRacesFirstReader(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	acquireOK(t, b, "k", "w0", time.Minute) // K has a row: the writer's UPDATE meets it
	require.NoError(t, b.Release(testCtx(t), sqllock.Lease{Key: "k", Token: 1, Owner: "w0"}))
	go1 := stallSlotInserts(t, b, 7245291000000004344)
	reader := goTry(t, b, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "stalled", Shared: true})
	pid := waitStalled(t, b, 7245291000000004344)
	writer := goTry(t, b, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "w"})
	waitBlockedBy(t, b, pid, 1)
	go1()
	r, w := <-reader, <-writer
	require.NoError(t, r.err)
	require.ErrorIs(t, w.err, sqllock.ErrNotAcquired, "a writer granted beside a reader: %+v", w.l)
	_, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "w"})
	var he *sqllock.HeldError
	require.ErrorAs(t, err, &he)
	require.Equal(t, 1, he.Shared)
}

// A reader's release and a forced release of its slot wait together on
// K's row (locked by another transaction): the first to get it releases
// the slot and counts one reader fewer; the second finds the slot's
// newest row released and counts nothing, so K stays held by the other
// reader.
func TestSharedTwoReleasesOfOneSlotCountOnce(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	r1, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "r1", Shared: true})
	require.NoError(t, err)
	r2, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "r2", Shared: true})
	require.NoError(t, err)
	pid, rollback := lockRows(t, adminPool(b), b.table, "k")
	done := make(chan error, 2)
	for _, l := range []sqllock.Lease{r1, {Key: r1.Key, Token: r1.Token, Owner: "admin"}} {
		go func() { done <- b.Release(testCtx(t), l) }()
	}
	waitQueuedBehind(t, b, int(pid), 2)
	rollback()
	for range 2 {
		if err := <-done; err != nil {
			require.ErrorIs(t, err, sqllock.ErrLeaseLost)
		}
	}
	all, err := b.List(testCtx(t), "k")
	require.NoError(t, err)
	require.Equal(t, "k", all[0].Key)
	require.True(t, all[0].Held, "K freed beside reader %s: %+v", r2.Key, all)
	require.Equal(t, 1, all[0].Shared, "readers counted on K: %+v", all)
	_, err = b.TryRenew(testCtx(t), r2, time.Minute)
	require.NoError(t, err)
	require.NoError(t, b.Release(testCtx(t), r2))
	acquireOK(t, b, "k", "w", time.Minute) // the count reached 0: K is free
}

// A set refused by a key that readers hold says so as a single
// exclusive acquire's refusal does: no owner, the readers' count, and
// the time until the last reader's deadline; nothing of the set granted.
func TestSetRefusedByReadersReportsTheirCount(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	ctx := testCtx(t)
	for _, owner := range []string{"r1", "r2"} {
		_, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "b", TTL: time.Minute, Owner: owner, Shared: true})
		require.NoError(t, err)
	}
	_, err := b.TryAcquireAll(ctx, sqllock.MultiAcquireRequest{Keys: []string{"a", "b", "c"}, TTL: time.Minute, Owner: "set"})
	require.ErrorIs(t, err, sqllock.ErrNotAcquired)
	var he *sqllock.HeldError
	require.ErrorAs(t, err, &he)
	require.Equal(t, "b", he.Key)
	require.Empty(t, he.Owner)
	require.Equal(t, 2, he.Shared, "the readers' count in %+v", he)
	require.Greater(t, he.Remaining, 50*time.Second)
	_, single := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "b", TTL: time.Minute, Owner: "w"})
	var hs *sqllock.HeldError
	require.ErrorAs(t, single, &hs)
	require.Equal(t, hs.Shared, he.Shared, "a set's refusal and a single acquire's differ")
	all, err := b.List(ctx, "")
	require.NoError(t, err)
	for _, i := range all {
		require.NotEqual(t, "set", i.Owner, "a key of the refused set was granted: %+v", i)
	}
}

// waitQueuedBehind waits until n sessions wait on session pid, directly
// or behind another waiter (the second waiter for a row lock waits on
// the first's tuple lock, not on pid).
func waitQueuedBehind(t *testing.T, b *Backend, pid, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for got := 0; got < n; {
		require.True(t, time.Now().Before(deadline), "fewer than %d statements came to wait on session %d", n, pid)
		time.Sleep(2 * time.Millisecond)
		require.NoError(t, adminPool(b).QueryRow(testCtx(t), `WITH RECURSIVE w(pid) AS (
				SELECT a.pid FROM pg_stat_activity AS a WHERE $1::int = ANY(pg_blocking_pids(a.pid))
				UNION SELECT a.pid FROM pg_stat_activity AS a, w WHERE w.pid = ANY(pg_blocking_pids(a.pid)))
			SELECT count(*) FROM w`, pid).Scan(&got))
	}
}

// A reader's renewal queued behind a forced release of its slot (both
// wait on K's row, which another transaction holds, the release first)
// finds the slot's newest row released: it reports the loss and renews
// neither the slot nor K.
func TestSharedRenewAfterForcedReleaseIsLost(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	r1, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "r1", Shared: true})
	require.NoError(t, err)
	r2, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "r2", Shared: true})
	require.NoError(t, err)
	pid, rollback := lockRows(t, adminPool(b), b.table, "k")
	released := make(chan error, 1)
	go func() { released <- b.Release(testCtx(t), sqllock.Lease{Key: r1.Key, Token: r1.Token, Owner: "admin"}) }()
	waitQueuedBehind(t, b, int(pid), 1)
	renewed := make(chan error, 1)
	go func() {
		_, err := b.TryRenew(testCtx(t), r1, 2*time.Minute)
		renewed <- err
	}()
	waitQueuedBehind(t, b, int(pid), 2)
	rollback()
	require.NoError(t, <-released)
	err = <-renewed
	var lost *sqllock.LostError
	require.ErrorAs(t, err, &lost, "a renewal after its slot's forced release")
	require.Equal(t, sqllock.LostReleased, lost.Reason)
	all, err := b.List(testCtx(t), "k")
	require.NoError(t, err)
	require.Equal(t, "k", all[0].Key)
	require.Equal(t, 1, all[0].Shared, "readers counted on K: %+v", all)
	require.Less(t, all[0].Remaining, 61*time.Second, "K's deadline moved by the lost renewal: %+v", all)
	_, err = b.TryRenew(testCtx(t), r2, time.Minute)
	require.NoError(t, err)
}

// The shared statements find K's row and its reader slots through the
// key's index in the plan the server keeps for them, as a set's do
// (TestSetStatementsFindRowsByIndex): a plan that joined the slots'
// numbers with the table read all of it, about 1 ms a shared acquire at
// 10,000 keys (docs/shared-locks.md#cost).
func TestSharedStatementsFindRowsByIndex(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, args string
		statement  func(b *Backend) string
	}{
		{"shared_acquire", `'k7', 60000000, 'w', NULL`, func(b *Backend) string { return b.full.sharedAcquire }},
		{"shared_acquire_wait", `'k7', 60000000, 'w', NULL`, func(b *Backend) string { return b.full.sharedAcquireWait }},
		{"shared_renew", `'k7#shared-1', 1, 60000000, 'k7'`, func(b *Backend) string { return b.full.sharedRenew }},
		{"shared_release", `'k7#shared-1', 1, 'w', 'k7'`, func(b *Backend) string { return b.full.sharedRelease }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			requireIndexedPlans(t, tc.statement, tc.args)
		})
	}
}

// A reaper never deletes a reader slot, not even one released and
// expired long ago under a key still read: the slot is its key's.
func TestReapLeavesReaderSlots(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	_, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "s", TTL: time.Minute, Owner: "r0", Shared: true})
	require.NoError(t, err)
	r1, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "s", TTL: time.Minute, Owner: "r1", Shared: true})
	require.NoError(t, err)
	require.NoError(t, b.Release(testCtx(t), r1))
	expire(t, b, r1.Key)
	_, err = b.Reap(testCtx(t), 0, 100)
	require.NoError(t, err)
	var n int
	require.NoError(t, adminPool(b).QueryRow(testCtx(t), "SELECT count(*) FROM "+b.table+" WHERE key = $1", r1.Key).Scan(&n))
	require.Equal(t, 1, n, "the reaper deleted reader slot %s", r1.Key)
}

// A table at 00006 whose lease a Backend of that version holds is
// upgraded by 00007 (shared locks) while it is held: no row changes, the
// lease renews through either Backend and is refused to readers and
// writers. The old Backend (the statements of version 6, as the previous
// release sent them) refuses a shared request before any I/O, and fails
// closed beside readers: its acquire sees K's row held (the readers'
// summary, no owner) and never grants K beside a reader; once they have
// left, it takes K above their tokens.
func TestUpgradeToSharedKeepsLeases(t *testing.T) {
	t.Parallel()
	db, upgrade := schemaAt(t, 6)
	old, err := New(db.Pool, Options{})
	require.NoError(t, err)
	defer old.Close()
	ctx := testCtx(t)
	held := acquireOK(t, old, "held", "old-h", time.Hour)
	rows := func() [][]any {
		r, err := db.Pool.Query(ctx, `SELECT key, token, held, deadline, owner, waited, value, hold_until FROM `+old.table+` ORDER BY key`)
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
	_, err = b.TryRenew(ctx, held, time.Hour)
	require.NoError(t, err, "the lease held across the upgrade renews (new Backend)")
	_, err = old.TryRenew(ctx, held, time.Hour)
	require.NoError(t, err, "the lease held across the upgrade renews (old Backend)")
	_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "held", TTL: time.Minute, Owner: "r", Shared: true})
	require.ErrorIs(t, err, sqllock.ErrNotAcquired, "a reader beside the lease held across the upgrade")
	_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "held", TTL: time.Minute, Owner: "w"})
	require.ErrorIs(t, err, sqllock.ErrNotAcquired)

	_, err = old.TryAcquire(ctx, sqllock.AcquireRequest{Key: "doc", TTL: time.Minute, Owner: "old-r", Shared: true})
	require.ErrorIs(t, err, sqllock.ErrSchemaMissing, "a Backend that read version 6 grants no shared request")
	var readers []sqllock.Lease
	for _, o := range []string{"r1", "r2"} {
		l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "doc", TTL: time.Minute, Owner: o, Shared: true})
		require.NoError(t, err)
		readers = append(readers, l)
	}
	for range 3 {
		_, err := old.TryAcquire(ctx, sqllock.AcquireRequest{Key: "doc", TTL: time.Minute, Owner: "old-w"})
		require.ErrorIs(t, err, sqllock.ErrNotAcquired, "the old acquire beside readers: fails closed")
	}
	require.NoError(t, b.Release(ctx, readers[0]))
	_, err = old.TryAcquire(ctx, sqllock.AcquireRequest{Key: "doc", TTL: time.Minute, Owner: "old-w"})
	require.ErrorIs(t, err, sqllock.ErrNotAcquired, "the old acquire beside the last reader")
	require.NoError(t, b.Release(ctx, readers[1]))
	w := acquireOK(t, old, "doc", "old-w", time.Minute)
	require.Greater(t, w.Token, readers[1].Token, "the old Backend's grant after the readers: above their tokens")
	require.NoError(t, old.Release(ctx, held))
}

// A refused shared request writes nothing: no transaction id, no WAL,
// whether a writer holds the key, a waiting writer's mark keeps readers
// out, or every slot is taken; and it takes no row lock, so it never
// waits for one: it is refused at once while another transaction holds
// K's row locked (a fenced transaction's FOR SHARE, here FOR UPDATE).
func TestRefusedSharedWritesNothing(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	st, err := b.statements(ctx, "acquire", "w")
	require.NoError(t, err)
	acquireOK(t, b, "w", "writer", time.Hour)
	_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "m", TTL: time.Hour, Owner: "r0", Shared: true})
	require.NoError(t, err)
	_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "m", TTL: time.Hour, Owner: "mw", Mark: true})
	require.ErrorIs(t, err, sqllock.ErrNotAcquired)
	for _, key := range []string{"w", "m"} {
		args := []any{key, int64(60_000_000), "r", nil}
		tx, err := bundle.db.Pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { tx.Rollback(context.Background()) })
		var granted bool
		var skip [15]any
		dest := []any{&granted}
		for i := range skip {
			dest = append(dest, &skip[i])
		}
		require.NoError(t, tx.QueryRow(ctx, st.sharedAcquire, args...).Scan(dest...))
		require.False(t, granted, "%s: granted", key)
		var xid *int64
		require.NoError(t, tx.QueryRow(ctx, "SELECT pg_current_xact_id_if_assigned()::text::bigint").Scan(&xid))
		require.Nil(t, xid, "%s: a refused shared acquire assigned a transaction id", key)
		require.NoError(t, tx.Rollback(ctx))
		records, bytes := planWAL(t, b, st.sharedAcquire, args...)
		require.Zero(t, records, "%s: a refused shared acquire wrote WAL (%d bytes)", key, bytes)

		lock, err := bundle.db.Pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { lock.Rollback(context.Background()) })
		_, err = lock.Exec(ctx, "SELECT FROM "+b.table+" WHERE key = $1 FOR UPDATE", key)
		require.NoError(t, err)
		short, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, err = b.TryAcquire(short, sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: "r", Shared: true})
		cancel()
		require.ErrorIs(t, err, sqllock.ErrNotAcquired, "%s: a refused shared acquire waited on a locked row", key)
		require.NoError(t, lock.Rollback(ctx))
	}
}

// A reader waiting on a writer (its key watched) marks the writer's lease
// on its refused attempt, as an exclusive waiter does, so that the
// writer's release wakes it at once; the mark is made once per tenure.
func TestWaitingReaderWokenByWritersRelease(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	ch, stop := b.Watch("k")
	defer stop()
	listening(t, b, ch)
	for range 3 {
		w := acquireOK(t, b, "k", "w", time.Minute)
		for range 2 {
			_, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "r", Shared: true})
			require.ErrorIs(t, err, sqllock.ErrNotAcquired)
		}
		require.NoError(t, b.Release(testCtx(t), w))
		wakeWithin(t, ch, 10*time.Second, "the writer's release, a reader waiting")
	}
}

// A forced release of a key held shared ends its readers' fences as it
// ends their renewals (LostReleased): a reader's slot row is still held
// with its token afterwards, and a writer may hold the key, so a fence
// that checked the slot alone would let a reader of the ended epoch run
// a fenced transaction beside the writer. On a pgx pool and on a *sql.DB.
func TestReaderFenceEndsWithForcedRelease(t *testing.T) {
	t.Parallel()
	noop := func(pgx.Tx) error { return nil }
	noopSQL := func(*sql.Tx) error { return nil }
	run := func(t *testing.T, b *Backend, admin *pgxpool.Pool, fence func(sqllock.Lease) error) {
		ctx := testCtx(t)
		r, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "f", TTL: time.Minute, Owner: "r", Shared: true})
		require.NoError(t, err)
		require.NoError(t, fence(r), "a live reader's fence")
		var token int64
		require.NoError(t, admin.QueryRow(ctx, "SELECT token FROM "+b.table+" WHERE key = 'f'").Scan(&token))
		if err := b.Release(ctx, sqllock.Lease{Key: "f", Token: token, Owner: "admin"}); err != nil {
			require.ErrorIs(t, err, sqllock.ErrLeaseLost, "forced release of f")
		}
		w, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "f", TTL: time.Minute, Owner: "w"})
		require.NoError(t, err, "a writer after the forced release")
		var lost *sqllock.LostError
		require.ErrorAs(t, fence(r), &lost, "the fence of a reader whose epoch a forced release ended, beside writer %+v", w)
		require.Equal(t, sqllock.LostReleased, lost.Reason)
	}
	t.Run("pool", func(t *testing.T) {
		t.Parallel()
		b := newBundle(t, Options{}).backend
		run(t, b, adminPool(b), func(l sqllock.Lease) error { return b.FencedTx(testCtx(t), l, noop) })
	})
	for _, d := range sqlDrivers {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			bundle, b := dbBundle(t, d, Options{})
			run(t, b, bundle.db.Pool, func(l sqllock.Lease) error { return b.FencedSQLTx(testCtx(t), l, noopSQL) })
		})
	}
}
