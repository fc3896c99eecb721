package postgres

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/pgtest"
	"github.com/ashlock/ashlock/sqllock"
)

// compactOn runs test on each flavour of Backend, each in a database of
// its own (pgtest.NewDatabase): VACUUM and REINDEX CONCURRENTLY wait for,
// or keep what is visible to, every older transaction of the database,
// the other tests' too.
func compactOn(t *testing.T, test func(t *testing.T, b *Backend)) {
	t.Run("pgxpool", func(t *testing.T) {
		t.Parallel()
		test(t, isolated(t))
	})
	for _, d := range sqlDrivers {
		t.Run("sql-"+d.name, func(t *testing.T) {
			t.Parallel()
			bundle := newBundleIn(t, pgtest.NewDatabase(t), Options{})
			test(t, newDBBackend(t, bundle, openDB(t, bundle, d, ""), Options{}))
		})
	}
}

// isolated is a Backend on a pgx pool in a database of its own.
func isolated(t *testing.T) *Backend {
	return newBundleIn(t, pgtest.NewDatabase(t), Options{}).backend
}

// burst fills b's table as a service of per-entity keys leaves it: n keys
// each locked once and released two hours ago (bulk SQL writing what an
// acquire and a release write), then live keys acquired for real with a
// value, whose rows go after them, at the table's end. It reaps the n
// (sqllock.Reap, 1h) and returns the live leases.
func burst(t *testing.T, b *Backend, n, live int) []sqllock.Lease {
	t.Helper()
	_, err := adminPool(b).Exec(testCtx(t), `INSERT INTO `+b.table+` (key, token, held, deadline, owner)
		SELECT format('order:%s', lpad(i::text, 8, '0')), 1, false, now() - interval '2 hours', 'burst-releaser'
		FROM generate_series(1, $1) AS i`, n)
	require.NoError(t, err)
	leases := make([]sqllock.Lease, live)
	for i := range leases {
		l, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: fmt.Sprintf("live:%05d", i), TTL: time.Hour,
			Owner: fmt.Sprintf("holder-%d", i), Value: []byte("value-of-a-live-key")})
		require.NoError(t, err)
		leases[i] = l
	}
	reaped, err := sqllock.Reap(testCtx(t), b, time.Hour)
	require.NoError(t, err)
	require.Equal(t, n, reaped)
	return leases
}

// rowsOf is every row of b's table but its place (ctid), in key order.
func rowsOf(t *testing.T, b *Backend) string {
	t.Helper()
	var s string
	require.NoError(t, adminPool(b).QueryRow(testCtx(t), `SELECT coalesce(string_agg(row(l.*)::text, E'\n' ORDER BY l.key), '') FROM `+b.table+` AS l`).Scan(&s))
	return s
}

// sizeOf is the table's and its indexes' bytes on disk, after a VACUUM.
func sizeOf(t *testing.T, b *Backend) int64 {
	t.Helper()
	_, err := adminPool(b).Exec(testCtx(t), `VACUUM `+b.table)
	require.NoError(t, err)
	var n int64
	require.NoError(t, adminPool(b).QueryRow(testCtx(t), `SELECT pg_table_size($1::regclass) + pg_indexes_size($1::regclass)`, b.table).Scan(&n))
	return n
}

// invalidIndexes counts the table's invalid indexes (a failed REINDEX
// CONCURRENTLY's).
func invalidIndexes(t *testing.T, b *Backend) int {
	t.Helper()
	var n int
	require.NoError(t, adminPool(b).QueryRow(testCtx(t), `SELECT count(*) FROM pg_index WHERE indrelid = $1::regclass AND NOT indisvalid`, b.table).Scan(&n))
	return n
}

// After a burst of keys, reaped, the live keys sit in the table's last
// pages, and VACUUM gives back nothing: Compact moves them to the start,
// and the table with its index comes back within 2× of a table that only
// ever held the live keys, with every row as it was and every lease going
// on as before.
func TestCompact(t *testing.T) {
	t.Parallel()
	const n, live = 40000, 200
	ref := isolated(t)
	for i := range live {
		_, err := ref.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: fmt.Sprintf("live:%05d", i), TTL: time.Hour,
			Owner: fmt.Sprintf("holder-%d", i), Value: []byte("value-of-a-live-key")})
		require.NoError(t, err)
	}
	refSize := sizeOf(t, ref)
	compactOn(t, func(t *testing.T, b *Backend) {
		leases := burst(t, b, n, live)
		vacuumed := sizeOf(t, b)
		require.Greater(t, vacuumed, 10*refSize, "the burst's space stays after a plain VACUUM (the case Compact is for)")
		rows := rowsOf(t, b)

		cs, err := b.Compact(testCtx(t))
		require.NoError(t, err)
		t.Logf("compact: %+v; reference %d bytes, after the reap %d", cs, refSize, vacuumed)
		require.EqualValues(t, live, cs.Rows)
		require.Positive(t, cs.Moved)
		require.Zero(t, cs.Left)
		require.Less(t, cs.TableBytes[1], cs.TableBytes[0])
		require.Less(t, cs.IndexBytes[1], cs.IndexBytes[0])
		require.Equal(t, rows, rowsOf(t, b), "a row changed")
		require.Zero(t, invalidIndexes(t, b))
		after := sizeOf(t, b)
		require.LessOrEqual(t, after, 2*refSize, "compacted: %d bytes, against %d for a table that only held the live keys", after, refSize)

		for _, l := range leases {
			r, err := b.TryRenew(testCtx(t), l, time.Hour)
			require.NoError(t, err)
			require.Equal(t, l.Token, r.Token)
			require.NoError(t, b.Release(testCtx(t), r))
			again := acquireOK(t, b, l.Key, "next", time.Minute)
			require.Equal(t, l.Token+1, again.Token)
		}
	})
}

// Compact never waits for a row another transaction has locked, and
// leaves it where it is: here a fenced transaction holds a live key of
// the table's end. Its rebuild of the index then waits for that
// transaction, older than it, until ctx ends; the invalid index the
// cancelled rebuild leaves is dropped by the next Compact, which finishes
// the job once the transaction is over.
func TestCompactSkipsLockedRows(t *testing.T) {
	t.Parallel()
	b := isolated(t)
	leases := burst(t, b, 5000, 100)
	fenced := leases[len(leases)-1]
	place := func() (s string) {
		require.NoError(t, adminPool(b).QueryRow(testCtx(t), `SELECT ctid::text FROM `+b.table+` WHERE key = $1`, fenced.Key).Scan(&s))
		return s
	}
	was := place()
	inTx, done := make(chan struct{}), make(chan struct{})
	fencedErr := make(chan error, 1)
	go func() {
		fencedErr <- b.FencedTx(testCtx(t), fenced, func(tx pgx.Tx) error {
			close(inTx)
			<-done
			return nil
		})
	}()
	<-inTx
	closed := false
	defer func() {
		if !closed {
			close(done)
		}
	}()
	// Compact waits up to horizonWait for the fenced transaction before
	// each VACUUM (three of them here), then its rebuild waits until ctx
	// ends.
	ctx, cancel := context.WithTimeout(testCtx(t), 15*time.Second)
	defer cancel()
	start := time.Now()
	cs, err := b.Compact(ctx)
	require.Error(t, err, "the index rebuild waits for the fenced transaction")
	require.ErrorIs(t, err, sqllock.ErrUnavailable)
	require.ErrorContains(t, err, "rebuilding index")
	require.Equal(t, 1, invalidIndexes(t, b), "the cancelled rebuild's index, which the fenced transaction keeps from being dropped at once")
	t.Logf("compact under a fenced transaction: %+v after %v: %v", cs, time.Since(start), err)
	// The fenced row stays (on a loaded machine, with the transaction
	// open, the moves of the others sometimes made no progress either:
	// Left 100 in 2 of 3 parallel runs; not explained yet, and the next
	// Compact moves them).
	require.GreaterOrEqual(t, cs.Left, int64(1), "the fenced row is not counted as left")
	require.Equal(t, was, place(), "the fenced row moved")
	close(done)
	closed = true
	require.NoError(t, <-fencedErr, "the fenced transaction commits: its lease and its row are as they were")

	cs, err = b.Compact(testCtx(t))
	require.NoError(t, err)
	require.Zero(t, cs.Left)
	require.NotEqual(t, was, place())
	require.Zero(t, invalidIndexes(t, b), "the cancelled rebuild's index is still there")
}

// Acquires, renewals and releases go on while Compact moves the rows they
// use: none fails, and tokens go on +1.
func TestCompactUnderTraffic(t *testing.T) {
	t.Parallel()
	b := isolated(t)
	leases := burst(t, b, 20000, 200)
	ctx, stop := context.WithCancel(testCtx(t))
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for w := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := w; ctx.Err() == nil; i = (i + 4) % len(leases) {
				l := leases[i]
				r, err := b.TryRenew(ctx, l, time.Hour)
				if ctx.Err() != nil {
					return
				}
				if err != nil {
					errs <- fmt.Errorf("renew %s: %w", l.Key, err)
					return
				}
				if err := b.Release(ctx, r); err != nil && ctx.Err() == nil {
					errs <- fmt.Errorf("release %s: %w", l.Key, err)
					return
				}
				next, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: l.Key, TTL: time.Hour, Owner: l.Owner})
				if ctx.Err() != nil {
					return
				}
				if err != nil || next.Token != l.Token+1 {
					errs <- fmt.Errorf("acquire %s after token %d: %v, %v", l.Key, l.Token, next.Token, err)
					return
				}
				leases[i] = next
			}
		}()
	}
	cs, err := b.Compact(testCtx(t))
	stop()
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	require.NoError(t, err)
	t.Logf("compact under traffic: %+v", cs)
	require.Positive(t, cs.Moved)
}

// The compaction's statements render for a table of any name.
func TestCompactStatementsRender(t *testing.T) {
	for _, name := range []string{"compact_measure", "compact_left", "compact_move"} {
		q := fillCompact(name, compactSchema{Table: `"s"."t"`, Cut: 7, Batch: 3, Rounds: 2})
		require.Contains(t, q, `"s"."t"`, name)
	}
}

// A transaction with a snapshot from before Compact's moves keeps the
// moved rows' old versions visible: VACUUM cannot free them, nor truncate
// the table's end, while it lasts. Compact waits for such transactions (up
// to horizonWait) before each VACUUM, so a short one ending during it
// costs nothing.
func TestCompactWaitsForOlderSnapshots(t *testing.T) {
	t.Parallel()
	b := isolated(t)
	burst(t, b, 20000, 100)
	tx, err := adminPool(b).BeginTx(testCtx(t), pgx.TxOptions{IsoLevel: pgx.RepeatableRead})
	require.NoError(t, err)
	var n int
	if err := tx.QueryRow(testCtx(t), `SELECT count(*) FROM `+b.table).Scan(&n); err != nil {
		_ = tx.Rollback(context.Background())
		t.Fatal(err)
	}
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		time.Sleep(500 * time.Millisecond)
		_ = tx.Commit(context.Background())
	}()
	defer func() { <-ended }()
	cs, err := b.Compact(testCtx(t))
	require.NoError(t, err)
	t.Logf("compact beside an older snapshot: %+v", cs)
	require.Zero(t, cs.Left)
	require.Less(t, 4*cs.TableBytes[1], cs.TableBytes[0], "the table did not shrink")
}
