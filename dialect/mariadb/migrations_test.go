package mariadb

import (
	"database/sql"
	"hash/crc64"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pressly/goose/v3/database"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/mariatest"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// Up applies every migration once, into the library's own version table;
// a second Up, and several at once from separate handles, change nothing.
func TestMigrationsUpIsIdempotentAndSerialized(t *testing.T) {
	s := mariatest.Server(t)
	name := mariatest.Database(t, s)
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		db := mariatest.Open(t, s.Addr, name)
		wg.Go(func() { errs[i] = migrations.Up(testCtx(t), migrations.MariaDB, db, migrations.Options{}) })
	}
	wg.Wait()
	for _, err := range errs {
		require.NoError(t, err)
	}
	db := mariatest.Open(t, s.Addr, name)
	require.NoError(t, migrations.Up(testCtx(t), migrations.MariaDB, db, migrations.Options{}))
	// goose's MySQL store scans its timestamps into time.Time: Status
	// needs the driver's parseTime.
	withTime, err := sql.Open("mysql", mariatest.DSN(s.Addr, name)+"&parseTime=true")
	require.NoError(t, err)
	defer withTime.Close()
	st, err := migrations.Status(testCtx(t), migrations.MariaDB, withTime, migrations.Options{})
	require.NoError(t, err)
	require.Len(t, st, 6)
	for _, m := range st {
		require.Equal(t, "applied", string(m.State), "%d", m.Source.Version)
	}
	var n int
	require.NoError(t, db.QueryRowContext(testCtx(t), "SELECT COUNT(*) FROM sqllock_locks_version WHERE version_id > 0").Scan(&n))
	require.Equal(t, 6, n, "each migration recorded once")
}

// The token history cannot be rewritten by hand: lowering a token,
// renaming a key, deleting a row and REPLACE (a delete, then an insert)
// are refused by the triggers; raising a token is allowed.
func TestMigrationsKeepTokensForward(t *testing.T) {
	b, db := newBackend(t)
	l, err := b.TryAcquire(testCtx(t), acq("k"))
	require.NoError(t, err)
	require.NoError(t, b.Release(testCtx(t), l))
	setToken(t, db, b, "k", 5)
	for _, q := range []string{
		"UPDATE sqllock_locks SET token = 1 WHERE `key` = 'k'",
		"UPDATE sqllock_locks SET `key` = 'renamed' WHERE `key` = 'k'",
		"DELETE FROM sqllock_locks WHERE `key` = 'k'",
		"REPLACE INTO sqllock_locks (`key`, token, held, deadline, owner) VALUES ('k', 1, 0, UTC_TIMESTAMP(6), 'x')",
	} {
		_, err := db.ExecContext(testCtx(t), q)
		require.Error(t, err, q)
		require.Contains(t, err.Error(), "sqllock: ", q)
	}
	i, err := b.List(testCtx(t), "k")
	require.NoError(t, err)
	require.Len(t, i, 1)
	require.Equal(t, int64(5), i[0].Token)
	next, err := b.TryAcquire(testCtx(t), acq("k"))
	require.NoError(t, err)
	require.Equal(t, int64(6), next.Token)
}

// A handle without the table reports ErrSchemaMissing, and a table of
// another name is found through Options.Table.
func TestSchemaMissingAndTableOption(t *testing.T) {
	db := mariatest.DB(t)
	b, err := New(db, Options{})
	require.NoError(t, err)
	defer b.Close()
	_, err = b.TryAcquire(testCtx(t), acq("k"))
	require.ErrorIs(t, err, sqllock.ErrSchemaMissing)
	_, err = b.List(testCtx(t), "")
	require.ErrorIs(t, err, sqllock.ErrSchemaMissing)

	migrated(t, db, Options{Table: "other_locks"})
	b2, err := New(db, Options{Table: "other_locks"})
	require.NoError(t, err)
	defer b2.Close()
	_, err = b2.TryAcquire(testCtx(t), acq("k"))
	require.NoError(t, err)
	sqlText, err := migrations.SQL(migrations.MariaDB, migrations.Options{Table: "other_locks"}, migrations.DirectionUp)
	require.NoError(t, err)
	require.True(t, strings.Contains(sqlText, "CREATE TABLE `other_locks`"), sqlText)
}

// The token space ends closed whatever the session's sql_mode: a
// non-strict mode would clamp an out-of-range value to the largest token
// and grant it again.
func TestTokenExhaustionWithoutStrictMode(t *testing.T) {
	s := mariatest.Server(t)
	name := mariatest.Database(t, s)
	db := mariatest.Open(t, s.Addr, name)
	migrated(t, db, Options{})
	loose, err := sql.Open("mysql", mariatest.DSN(s.Addr, name)+"&sql_mode=%27%27")
	require.NoError(t, err)
	defer loose.Close()
	var mode string
	require.NoError(t, loose.QueryRowContext(testCtx(t), "SELECT @@SESSION.sql_mode").Scan(&mode))
	require.Empty(t, mode)
	b, err := New(loose, Options{})
	require.NoError(t, err)
	defer b.Close()
	setToken(t, db, b, "k", 1<<63-1)
	_, err = b.TryAcquire(testCtx(t), acq("k"))
	require.ErrorIs(t, err, sqllock.ErrTokenExhausted)
	i, err := b.List(testCtx(t), "k")
	require.NoError(t, err)
	require.False(t, i[0].Held, "nothing granted at the end of the token space")
}

// Up waits while another host's migration holds the table's named lock
// (GET_LOCK, per table and database), and goes on once it is released.
func TestMigrationsWaitForTheNamedLock(t *testing.T) {
	s := mariatest.Server(t)
	name := mariatest.Database(t, s)
	holder := mariatest.Open(t, s.Addr, name)
	conn, err := holder.Conn(testCtx(t))
	require.NoError(t, err)
	defer conn.Close()
	// The name package migrations derives for the default table.
	id := int64(crc64.Checksum([]byte("ashlock/migrations\x00\x00"+migrations.DefaultTable), crc64.MakeTable(crc64.ECMA)))
	lock := "ashlock/migrations/" + strconv.FormatInt(id, 16)
	var got int
	require.NoError(t, conn.QueryRowContext(testCtx(t), "SELECT GET_LOCK(CONCAT(?, '/', LEFT(MD5(DATABASE()), 16)), 5)", lock).Scan(&got))
	require.Equal(t, 1, got)

	done := make(chan error, 1)
	db := mariatest.Open(t, s.Addr, name)
	go func() { done <- migrations.Up(testCtx(t), migrations.MariaDB, db, migrations.Options{}) }()
	select {
	case err := <-done:
		t.Fatalf("Up ran while another migration held the lock: %v", err)
	case <-time.After(time.Second):
	}
	_, err = conn.ExecContext(testCtx(t), "DO RELEASE_LOCK(CONCAT(?, '/', LEFT(MD5(DATABASE()), 16)))", lock)
	require.NoError(t, err)
	require.NoError(t, <-done)
}

// An Up that finds the version table without its first row (a concurrent
// Up created the table, which MariaDB commits at once, and has not yet
// written the row: goose looks before it takes the migration lock) waits
// for the row and then migrates, instead of failing with goose's
// "missing zero version migration".
func TestUpWaitsForTheVersionTablesFirstRow(t *testing.T) {
	s := mariatest.Server(t)
	name := mariatest.Database(t, s)
	db := mariatest.Open(t, s.Addr, name)
	store, err := database.NewStore(database.DialectMySQL, "sqllock_locks_version")
	require.NoError(t, err)
	require.NoError(t, store.CreateVersionTable(testCtx(t), db))
	done := make(chan error, 1)
	other := mariatest.Open(t, s.Addr, name)
	go func() { done <- migrations.Up(testCtx(t), migrations.MariaDB, other, migrations.Options{}) }()
	select {
	case err := <-done:
		t.Fatalf("Up returned (%v) while the version table had no first row", err)
	case <-time.After(300 * time.Millisecond):
	}
	require.NoError(t, store.Insert(testCtx(t), db, database.InsertRequest{Version: 0}))
	require.NoError(t, <-done)
	var n int
	require.NoError(t, db.QueryRowContext(testCtx(t), "SELECT COUNT(*) FROM sqllock_locks_version WHERE version_id > 0").Scan(&n))
	require.Equal(t, 6, n, "every migration applied once")
}
