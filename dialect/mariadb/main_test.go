package mariadb

import (
	"context"
	"database/sql"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/sqlident"
	"github.com/ashlock/ashlock/internal/testkit/leakcheck"
	"github.com/ashlock/ashlock/internal/testkit/mariatest"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

func TestMain(m *testing.M) {
	if os.Getenv(stormEnv) != "" {
		os.Exit(stormChild())
	}
	code := mariatest.Main(m)
	os.Exit(leakcheck.Check(code))
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}

// migrated applies the migrations to db.
func migrated(t testing.TB, db *sql.DB, o Options) {
	t.Helper()
	require.NoError(t, migrations.Up(testCtx(t), migrations.MariaDB, db, migrations.Options{Table: o.Table}))
}

// newBackend is a Backend on a fresh, migrated database of the shared
// server, with its handle.
func newBackend(t testing.TB) (*Backend, *sql.DB) {
	t.Helper()
	db := mariatest.DB(t)
	migrated(t, db, Options{})
	b, err := New(db, Options{})
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })
	return b, db
}

func quotedTable(b *Backend) string { return sqlident.QuoteMariaDB(b.table) }

// expire makes key's lease end now (the token and held stay).
func expire(t testing.TB, db *sql.DB, b *Backend, key string) {
	t.Helper()
	_, err := db.ExecContext(testCtx(t), "UPDATE "+quotedTable(b)+" SET deadline = UTC_TIMESTAMP(6) WHERE `key` = ?", key)
	require.NoError(t, err)
}

// setToken makes key exist, released, at token.
func setToken(t testing.TB, db *sql.DB, b *Backend, key string, token int64) {
	t.Helper()
	_, err := db.ExecContext(testCtx(t), "INSERT INTO "+quotedTable(b)+" (`key`, token, held, deadline, owner) VALUES (?, ?, 0, UTC_TIMESTAMP(6), 'settoken') "+
		"ON DUPLICATE KEY UPDATE token = VALUES(token), held = 0, deadline = VALUES(deadline), owner = VALUES(owner), hold_until = NULL", key, token)
	require.NoError(t, err)
}

func acq(key string) sqllock.AcquireRequest {
	return sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: "o1"}
}
