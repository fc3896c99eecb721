package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	msqlite "modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/ashlock/ashlock/internal/sqlitecode"
	"github.com/ashlock/ashlock/internal/testkit/leakcheck"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
	"github.com/ashlock/ashlock/sqllock/backendtest"
)

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		os.Exit(helperMain())
	}
	code := m.Run()
	os.Exit(leakcheck.Check(code))
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// openTest opens a Backend on a fresh file in t.TempDir().
func openTest(t testing.TB, opts Options) (*Backend, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "locks.db")
	b, err := Open(path, opts)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, b.Close()) })
	return b, path
}

func execTest(t testing.TB, b sqllock.Backend, query string, args ...any) {
	t.Helper()
	sb := b.(*Backend)
	_, err := sb.db.ExecContext(testCtx(t), render(query, `"`+sb.table+`"`, nowMS), args...)
	require.NoError(t, err)
}

func TestConformance(t *testing.T) {
	t.Parallel()
	backendtest.Run(t, backendtest.Harness{
		New: func(t *testing.T) sqllock.Backend {
			b, _ := openTest(t, Options{})
			return b
		},
		Expire: func(t *testing.T, b sqllock.Backend, key string) {
			execTest(t, b, expireSQL, key)
		},
		SetToken: func(t *testing.T, b sqllock.Backend, key string, token int64) {
			execTest(t, b, setTokenSQL, key, token)
		},
	})
}

// TestConformanceNew runs the suite on an application's own *sql.DB (a pool
// of 4 built with DSN, a non-default table, migrated explicitly).
func TestConformanceNew(t *testing.T) {
	t.Parallel()
	backendtest.Run(t, backendtest.Harness{
		New: func(t *testing.T) sqllock.Backend {
			const table = "app_locks"
			name, err := DSN(filepath.Join(t.TempDir(), "app.db"), Options{Synchronous: SynchronousNormal})
			require.NoError(t, err)
			db, err := sql.Open("sqlite", name)
			require.NoError(t, err)
			db.SetMaxOpenConns(4)
			t.Cleanup(func() { require.NoError(t, db.Close()) })
			require.NoError(t, migrations.Up(testCtx(t), migrations.SQLite, db, migrations.Options{Table: table}))
			b, err := New(db, Options{Table: table})
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, b.Close()) })
			return b
		},
		Expire: func(t *testing.T, b sqllock.Backend, key string) {
			execTest(t, b, expireSQL, key)
		},
		SetToken: func(t *testing.T, b sqllock.Backend, key string, token int64) {
			execTest(t, b, setTokenSQL, key, token)
		},
	})
}

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

// TestSchemaMissing: New on a database without the table reports
// ErrSchemaMissing (naming `sqllock migrate up`) on use, and works once the
// migrations ran.
func TestSchemaMissing(t *testing.T) {
	t.Parallel()
	name, err := DSN(filepath.Join(t.TempDir(), "s.db"), Options{})
	require.NoError(t, err)
	db, err := sql.Open("sqlite", name)
	require.NoError(t, err)
	defer db.Close()
	b, err := New(db, Options{})
	require.NoError(t, err)
	defer b.Close()
	ctx := testCtx(t)
	req := sqllock.AcquireRequest{Key: "k", TTL: time.Second, Owner: "o"}
	_, err = b.TryAcquire(ctx, req)
	require.ErrorIs(t, err, sqllock.ErrSchemaMissing)
	require.Contains(t, err.Error(), "sqllock migrate up")
	_, err = b.List(ctx, "")
	require.ErrorIs(t, err, sqllock.ErrSchemaMissing)
	err = b.Release(ctx, sqllock.Lease{Key: "k", Token: 1})
	require.ErrorIs(t, err, sqllock.ErrSchemaMissing)

	require.NoError(t, migrations.Up(ctx, migrations.SQLite, db, migrations.Options{}))
	l, err := b.TryAcquire(ctx, req)
	require.NoError(t, err)
	require.Equal(t, int64(1), l.Token)
}

// TestUpgradeToValueKeepsLeases: a database at migration 00002 (before the
// value column) with a lease held by a process of the previous release is
// upgraded while the lease is held; this code refuses to run on the old
// table (ErrSchemaMissing, naming the fix, nothing written), and after
// `migrate up` the held lease keeps its token and deadline, renews, and is
// followed by the next token, now with a value.
func TestUpgradeToValueKeepsLeases(t *testing.T) {
	t.Parallel()
	name, err := DSN(filepath.Join(t.TempDir(), "u.db"), Options{})
	require.NoError(t, err)
	db, err := sql.Open("sqlite", name)
	require.NoError(t, err)
	defer db.Close()
	ctx := testCtx(t)
	p, err := migrations.NewProvider(migrations.SQLite, db, migrations.Options{})
	require.NoError(t, err)
	_, err = p.UpTo(ctx, 2)
	require.NoError(t, err)
	// The previous release's acquire, as it wrote the row.
	_, err = db.ExecContext(ctx, `INSERT INTO sqllock_locks (key, token, held, deadline, owner)
		VALUES ('k', 5, 1, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) + 60000, 'old')`)
	require.NoError(t, err)

	b, err := New(db, Options{})
	require.NoError(t, err)
	defer b.Close()
	_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k2", TTL: time.Second, Owner: "o", Value: []byte("v")})
	require.ErrorIs(t, err, sqllock.ErrSchemaMissing)
	require.Contains(t, err.Error(), "sqllock migrate up")
	var n int
	require.NoError(t, db.QueryRowContext(ctx, `SELECT count(*) FROM sqllock_locks`).Scan(&n))
	require.Equal(t, 1, n, "the refused acquire wrote nothing")

	require.NoError(t, migrations.Up(ctx, migrations.SQLite, db, migrations.Options{}))
	infos, err := b.List(ctx, "k")
	require.NoError(t, err)
	require.Len(t, infos, 1)
	require.True(t, infos[0].Held)
	require.Equal(t, int64(5), infos[0].Token)
	require.Equal(t, "old", infos[0].Owner)
	require.Nil(t, infos[0].Value)
	var he *sqllock.HeldError
	_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Second, Owner: "new"})
	require.ErrorAs(t, err, &he)
	require.Equal(t, int64(5), he.Token)
	old := sqllock.Lease{Key: "k", Token: 5, Owner: "old"}
	r, err := b.TryRenew(ctx, old, time.Minute)
	require.NoError(t, err, "the lease held across the upgrade renews")
	require.True(t, r.Deadline.After(infos[0].Deadline) || r.Deadline.Equal(infos[0].Deadline))
	require.NoError(t, b.Release(ctx, old))
	l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Second, Owner: "new", Value: []byte("10.0.0.7:8080")})
	require.NoError(t, err)
	require.Equal(t, int64(6), l.Token)
	require.Equal(t, []byte("10.0.0.7:8080"), l.Value)
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

// dataVersion returns a reader of PRAGMA data_version on a connection of its
// own to the database at path: its value moves when another connection
// (the Backend's) commits a change, and only then.
func dataVersion(t *testing.T, path string) func() int64 {
	t.Helper()
	name, err := DSN(path, Options{})
	require.NoError(t, err)
	other, err := sql.Open("sqlite", name)
	require.NoError(t, err)
	t.Cleanup(func() { other.Close() })
	other.SetMaxOpenConns(1)
	return func() (v int64) {
		require.NoError(t, other.QueryRowContext(testCtx(t), "PRAGMA data_version").Scan(&v))
		return v
	}
}

// TestRefusedOperationsWriteNothing: a refused acquire, a failed renew and
// a stale release commit nothing (another connection's PRAGMA data_version
// does not move), while a grant does.
func TestRefusedOperationsWriteNothing(t *testing.T) {
	t.Parallel()
	b, path := openTest(t, Options{})
	ctx := testCtx(t)
	version := dataVersion(t, path)
	l1, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o1"})
	require.NoError(t, err)
	execTest(t, b, expireSQL, "k")
	l2, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o2"})
	require.NoError(t, err)

	v := version()
	_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o3"})
	require.ErrorIs(t, err, sqllock.ErrNotAcquired)
	_, err = b.TryRenew(ctx, l1, time.Minute)
	require.ErrorIs(t, err, sqllock.ErrLeaseLost)
	require.ErrorIs(t, b.Release(ctx, l1), sqllock.ErrLeaseLost)
	require.Equal(t, v, version(), "a refused operation committed a change")

	// A longer TTL, so the deadline changes even within the same
	// millisecond (an identical row would not be written either).
	_, err = b.TryRenew(ctx, l2, 2*time.Minute)
	require.NoError(t, err)
	require.NotEqual(t, v, version(), "a renew committed nothing")
}

// TestTTLRoundsUp: a TTL is stored rounded up to whole milliseconds, plus
// one (see leaseMillis).
func TestTTLRoundsUp(t *testing.T) {
	t.Parallel()
	require.Equal(t, int64(1), ttlMillis(time.Nanosecond))
	require.Equal(t, int64(1), ttlMillis(time.Millisecond))
	require.Equal(t, int64(2), ttlMillis(time.Millisecond+time.Nanosecond))
	require.Equal(t, int64(86_400_000), ttlMillis(sqllock.MaxTTL))
	b, _ := openTest(t, Options{})
	for _, ttl := range []time.Duration{time.Millisecond, 1001 * time.Microsecond, 2*time.Second + 1} {
		l, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k" + ttl.String(), TTL: ttl, Owner: "o"})
		require.NoError(t, err)
		require.Equal(t, ttlMillis(ttl)+1, l.Deadline.Sub(l.BackendTime).Milliseconds(), "rounded up, and one tick of the clock more")
	}
}

func TestPrefixEnd(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{"": "", "a": "b", "job/": "job0", "a\xff": "b", "é": "\xc3\xaa"} {
		got, ok := prefixEnd(in)
		require.Equal(t, in != "", ok, "%q", in)
		require.Equal(t, want, got, "%q", in)
	}
	_, ok := prefixEnd("\xff\xff")
	require.False(t, ok)
}

// TestBusyIsRetriedThenUnavailable: while another connection holds the
// write lock, an operation retries (counted in Stats) and, after the retry
// budget or when its context ends, fails with ErrUnavailable, never with a
// raw SQLITE_BUSY; once the lock is gone it succeeds.
func TestBusyIsRetriedThenUnavailable(t *testing.T) {
	t.Parallel()
	b, path := openTest(t, Options{RetryTimeout: time.Second})
	ctx := testCtx(t)
	name, err := DSN(path, Options{})
	require.NoError(t, err)
	other, err := sql.Open("sqlite", name)
	require.NoError(t, err)
	defer other.Close()
	tx, err := other.BeginTx(ctx, nil) // BEGIN IMMEDIATE: holds the write lock
	require.NoError(t, err)

	req := sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o"}
	start := time.Now()
	_, err = b.TryAcquire(ctx, req)
	require.ErrorIs(t, err, sqllock.ErrUnavailable)
	require.False(t, isBusy(err), "raw busy error leaked: %v", err)
	require.GreaterOrEqual(t, time.Since(start), time.Second, "gave up before its retry budget")
	require.Less(t, time.Since(start), 10*time.Second)
	require.Greater(t, b.Stats().BusyRetries, uint64(1))

	// The caller's context ends the retry earlier.
	b2, err := Open(path, Options{RetryTimeout: time.Minute})
	require.NoError(t, err)
	defer b2.Close()
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	_, err = b2.TryAcquire(short, req)
	require.ErrorIs(t, err, sqllock.ErrUnavailable)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.True(t, strings.Contains(err.Error(), "not applied"), err.Error())

	require.NoError(t, tx.Rollback())
	_, err = b.TryAcquire(ctx, req)
	require.NoError(t, err)
}

// TestCancelledContext: a context that is already done is reported before
// any statement runs.
func TestCancelledContext(t *testing.T) {
	t.Parallel()
	b, _ := openTest(t, Options{})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Second, Owner: "o"})
	require.ErrorIs(t, err, context.Canceled)
	all, err := b.List(testCtx(t), "")
	require.NoError(t, err)
	require.Empty(t, all)
}

// TestTokenExhaustedGrantsNothing: at the largest token a free key is
// refused, a held one still reports its holder, and the token never wraps.
func TestTokenExhaustedGrantsNothing(t *testing.T) {
	t.Parallel()
	b, _ := openTest(t, Options{})
	ctx := testCtx(t)
	execTest(t, b, setTokenSQL, "k", int64(math.MaxInt64))
	_, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Second, Owner: "o"})
	require.ErrorIs(t, err, sqllock.ErrTokenExhausted)
	info, err := b.List(ctx, "k")
	require.NoError(t, err)
	require.Len(t, info, 1)
	require.Equal(t, int64(math.MaxInt64), info[0].Token)
	require.False(t, info[0].Held)
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

// TestNoBusySnapshot is SQ-2: two connections (two Backends on one file),
// two goroutines each, 500 acquire/renew/release cycles per goroutine on two
// keys: no error at all, in particular no SQLITE_BUSY (5) or
// SQLITE_BUSY_SNAPSHOT (517). The negative control shows the hazard is real:
// a deferred read-then-write transaction does get 517.
func TestNoBusySnapshot(t *testing.T) {
	t.Parallel()
	b1, path := openTest(t, Options{Synchronous: SynchronousNormal})
	b2, err := Open(path, Options{Synchronous: SynchronousNormal})
	require.NoError(t, err)
	defer b2.Close()
	ctx := testCtx(t)
	var wg sync.WaitGroup
	errs := make(chan error, 4)
	for i, b := range []*Backend{b1, b1, b2, b2} {
		wg.Go(func() {
			key := "k" + strconv.Itoa(i%2)
			for c := 0; c < 500; c++ {
				l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: fmt.Sprintf("g%d-%d", i, c)})
				if errors.Is(err, sqllock.ErrNotAcquired) {
					continue
				}
				if err == nil {
					l, err = b.TryRenew(ctx, l, time.Minute)
				}
				if err == nil {
					err = b.Release(ctx, l)
				}
				if err != nil {
					errs <- err
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Errorf("code %d: %v", code(err), err)
	}
	t.Logf("busy retries absorbed: %d + %d", b1.Stats().BusyRetries, b2.Stats().BusyRetries)

	// Negative control: _txlock=deferred, read, another connection
	// commits, write → SQLITE_BUSY_SNAPSHOT at once.
	db, err := sql.Open("sqlite", path+"?_pragma=busy_timeout(1000)&_txlock=deferred")
	require.NoError(t, err)
	defer db.Close()
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer tx.Rollback()
	var n int
	require.NoError(t, tx.QueryRowContext(ctx, `SELECT count(*) FROM sqllock_locks`).Scan(&n))
	_, err = b2.TryAcquire(ctx, sqllock.AcquireRequest{Key: "other", TTL: time.Minute, Owner: "o"})
	require.NoError(t, err)
	_, err = tx.ExecContext(ctx, `UPDATE sqllock_locks SET held = 0 WHERE key = 'none'`)
	var se *msqlite.Error
	require.ErrorAs(t, err, &se)
	require.Equal(t, sqlite3.SQLITE_BUSY_SNAPSHOT, se.Code(), "%v", err)
}

type fakeSQLiteError struct {
	code int
	msg  string
}

func (e *fakeSQLiteError) Error() string { return e.msg }
func (e *fakeSQLiteError) Code() int     { return e.code }

// TestTranslate: driver errors become ashlock's, once, at the boundary.
func TestTranslate(t *testing.T) {
	t.Parallel()
	b := &Backend{table: "sqllock_locks"}
	for _, tc := range []struct {
		name  string
		err   error
		write bool
		want  error
	}{
		{"NoSuchTable", &fakeSQLiteError{sqlite3.SQLITE_ERROR, "SQL logic error: no such table: sqllock_locks (1)"}, true, sqllock.ErrSchemaMissing},
		{"IOErrOnWriteIsIndeterminate", &fakeSQLiteError{sqlite3.SQLITE_IOERR | 4<<8, "disk I/O error (4106)"}, true, sqllock.ErrIndeterminate},
		{"IOErrOnReadIsUnavailable", &fakeSQLiteError{sqlite3.SQLITE_IOERR, "disk I/O error (10)"}, false, sqllock.ErrUnavailable},
		{"DiskFull", &fakeSQLiteError{sqlite3.SQLITE_FULL, "database or disk is full (13)"}, true, sqllock.ErrUnavailable},
		{"ReadOnlyIsPermanent", &fakeSQLiteError{sqlite3.SQLITE_READONLY, "attempt to write a readonly database (8)"}, true, ErrUnusable},
		{"ReadOnlyRecoveryIsTransient", &fakeSQLiteError{sqlite3.SQLITE_READONLY_RECOVERY, "attempt to write a readonly database (264)"}, true, sqllock.ErrUnavailable},
		{"NotADatabase", &fakeSQLiteError{sqlite3.SQLITE_NOTADB, "file is not a database (26)"}, false, ErrUnusable},
		{"CantOpen", &fakeSQLiteError{sqlite3.SQLITE_CANTOPEN, "unable to open database file (14)"}, false, ErrUnusable},
		{"Closed", errors.New("sql: database is closed"), true, sqllock.ErrClosed},
		{"Cancelled", context.Canceled, true, context.Canceled},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := b.translate(fmt.Errorf("wrapped: %w", tc.err), tc.write)
			require.ErrorIs(t, got, tc.want)
			if tc.want == ErrUnusable {
				// Permanent: never retried as if waiting could heal it.
				require.NotErrorIs(t, got, sqllock.ErrUnavailable)
			}
		})
	}
	require.True(t, isBusy(&fakeSQLiteError{sqlite3.SQLITE_BUSY_SNAPSHOT, "database is locked"}))
	require.True(t, isBusy(&fakeSQLiteError{sqlite3.SQLITE_LOCKED, "database table is locked"}))
	require.False(t, isBusy(&fakeSQLiteError{sqlite3.SQLITE_CONSTRAINT, "constraint"}))
	require.Nil(t, b.translate(nil, true))
}

func FuzzSQLite(f *testing.F) {
	b, _ := openTest(f, Options{})
	backendtest.Fuzz(f, b)
}

// internal/sqlitecode spells out the codes it shares with the migrations
// package (which must not link SQLite); they must be SQLite's.
func TestSharedResultCodes(t *testing.T) {
	t.Parallel()
	require.Equal(t, sqlite3.SQLITE_ERROR, sqlitecode.Error)
	require.Equal(t, sqlite3.SQLITE_BUSY, sqlitecode.Busy)
	require.Equal(t, sqlite3.SQLITE_LOCKED, sqlitecode.Locked)
}
