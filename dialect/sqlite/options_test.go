package sqlite

import (
	"database/sql"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// TestPragmasOnEveryPooledConn is SQ-3: the pragmas are DSN parameters, so
// every connection of a pool has them, not just the one a db.Exec reached.
func TestPragmasOnEveryPooledConn(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		opts Options
		sync int // PRAGMA synchronous reports a number
		busy int
	}{
		{"Defaults", Options{}, 2, 10},
		{"Normal", Options{Synchronous: SynchronousNormal, BusyTimeout: 25 * time.Millisecond}, 1, 25},
		{"RoundsUpBusyTimeout", Options{BusyTimeout: 1500 * time.Microsecond}, 2, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			name, err := DSN(filepath.Join(t.TempDir(), "p.db"), tc.opts)
			require.NoError(t, err)
			db, err := sql.Open("sqlite", name)
			require.NoError(t, err)
			defer db.Close()
			db.SetMaxOpenConns(4)
			ctx := testCtx(t)
			var conns []*sql.Conn
			for range 4 {
				c, err := db.Conn(ctx) // all four held at once: four connections
				require.NoError(t, err)
				conns = append(conns, c)
			}
			for i, c := range conns {
				var journal string
				var busy, sync, fk int
				require.NoError(t, c.QueryRowContext(ctx, "PRAGMA journal_mode").Scan(&journal))
				require.NoError(t, c.QueryRowContext(ctx, "PRAGMA busy_timeout").Scan(&busy))
				require.NoError(t, c.QueryRowContext(ctx, "PRAGMA synchronous").Scan(&sync))
				require.NoError(t, c.QueryRowContext(ctx, "PRAGMA foreign_keys").Scan(&fk))
				require.Equal(t, "wal", journal, "conn %d", i)
				require.Equal(t, tc.busy, busy, "conn %d", i)
				require.Equal(t, tc.sync, sync, "conn %d", i)
				require.Equal(t, 1, fk, "conn %d", i)
			}
			// _txlock=immediate: a BEGIN on one connection takes the write
			// lock at once, so another connection's write is busy.
			tx, err := conns[0].BeginTx(ctx, nil)
			require.NoError(t, err)
			_, err = conns[1].ExecContext(ctx, "CREATE TABLE x (a INTEGER)")
			require.True(t, isBusy(err), "write during another's BEGIN: %v", err)
			require.NoError(t, tx.Rollback())
			for _, c := range conns {
				require.NoError(t, c.Close())
			}
		})
	}

	// The Backend's own connection too.
	b, _ := openTest(t, Options{})
	var journal string
	var busy, sync int
	ctx := testCtx(t)
	require.NoError(t, b.db.QueryRowContext(ctx, "PRAGMA journal_mode").Scan(&journal))
	require.NoError(t, b.db.QueryRowContext(ctx, "PRAGMA busy_timeout").Scan(&busy))
	require.NoError(t, b.db.QueryRowContext(ctx, "PRAGMA synchronous").Scan(&sync))
	require.Equal(t, "wal", journal)
	require.Equal(t, 10, busy)
	require.Equal(t, 2, sync)
	require.Equal(t, 1, b.db.Stats().MaxOpenConnections)
}

// TestMemoryRefused is SQ-4: an in-memory database is refused, by Open, DSN
// and New, because each pooled connection would see its own database and
// the token history dies with the last connection.
func TestMemoryRefused(t *testing.T) {
	t.Parallel()
	for _, p := range []string{"", ":memory:", "file::memory:", "file::memory:?cache=shared", "file:x.db?mode=memory"} {
		_, err := Open(p, Options{})
		require.ErrorIs(t, err, ErrInMemory, "Open(%q)", p)
		_, err = DSN(p, Options{})
		require.ErrorIs(t, err, ErrInMemory, "DSN(%q)", p)
	}
	for _, dsn := range []string{":memory:", "file::memory:?cache=shared", "file:mem1?mode=memory&cache=shared", ""} {
		db, err := sql.Open("sqlite", dsn)
		require.NoError(t, err)
		_, err = New(db, Options{})
		require.ErrorIs(t, err, ErrInMemory, "New(%q)", dsn)
		require.NoError(t, db.Close())
	}
	// Other paths that are not plain file names.
	for _, p := range []string{"file:x.db", "a?b.db", "a\x00b"} {
		_, err := Open(p, Options{})
		require.Error(t, err, "Open(%q)", p)
		require.NotErrorIs(t, err, ErrInMemory)
	}
}

func TestOptions(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	for _, o := range []Options{
		{Table: "bad-name"},
		{Table: `x"; DROP TABLE t; --`},
		{Synchronous: "OFF"},
		{BusyTimeout: time.Microsecond},
		{BusyTimeout: time.Hour},
	} {
		_, err := Open(filepath.Join(dir, "o.db"), o)
		require.Error(t, err, "%+v", o)
	}
	// New refuses DSN-level settings it cannot apply.
	name, err := DSN(filepath.Join(dir, "n.db"), Options{})
	require.NoError(t, err)
	db, err := sql.Open("sqlite", name)
	require.NoError(t, err)
	defer db.Close()
	_, err = New(db, Options{Synchronous: SynchronousNormal})
	require.Error(t, err)
	_, err = New(db, Options{BusyTimeout: time.Second})
	require.Error(t, err)
	_, err = New(nil, Options{})
	require.Error(t, err)
	// A lowercase synchronous value is accepted.
	b, err := Open(filepath.Join(dir, "lower.db"), Options{Synchronous: "normal", Table: "other_locks"})
	require.NoError(t, err)
	require.NoError(t, b.Close())
	require.NoError(t, b.Close(), "Close twice")
	_, err = b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Second, Owner: "o"})
	require.ErrorIs(t, err, sqllock.ErrClosed)
}

// TestOpenTwice: a second Open of a migrated file (another process, a
// restart) finds the schema applied and the token history intact.
func TestOpenTwice(t *testing.T) {
	t.Parallel()
	b1, path := openTest(t, Options{})
	ctx := testCtx(t)
	l1, err := b1.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o1"})
	require.NoError(t, err)
	b2, err := Open(path, Options{})
	require.NoError(t, err)
	defer b2.Close()
	_, err = b2.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o2"})
	var he *sqllock.HeldError
	require.ErrorAs(t, err, &he)
	require.Equal(t, "o1", he.Owner)
	require.Equal(t, l1.Token, he.Token)
	require.NoError(t, b1.Release(ctx, l1))
	l2, err := b2.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o2"})
	require.NoError(t, err)
	require.Equal(t, l1.Token+1, l2.Token)
}

// TestConcurrentFirstOpen: several Opens of a new file at once (processes
// starting together) all succeed; the migration runs once.
func TestConcurrentFirstOpen(t *testing.T) {
	t.Parallel()
	path := filepath.Join(t.TempDir(), "first.db")
	const n = 8
	errs := make(chan error, n)
	backends := make(chan *Backend, n)
	start := make(chan struct{})
	for range n {
		go func() {
			<-start
			b, err := Open(path, Options{})
			errs <- err
			backends <- b
		}()
	}
	close(start)
	for range n {
		require.NoError(t, <-errs)
	}
	var tokens []int64
	for range n {
		b := <-backends
		l, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o" + strconv.Itoa(len(tokens))})
		require.NoError(t, err)
		require.NoError(t, b.Release(testCtx(t), l))
		tokens = append(tokens, l.Token)
		require.NoError(t, b.Close())
	}
	require.Equal(t, []int64{1, 2, 3, 4, 5, 6, 7, 8}, tokens)
}
