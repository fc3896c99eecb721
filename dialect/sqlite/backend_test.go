package sqlite

import (
	"database/sql"
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	msqlite "modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

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
