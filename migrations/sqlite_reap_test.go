package migrations_test

import (
	"context"
	"database/sql"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/dialect/sqlite"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// TestSQLiteUpgradeToReapingKeepsLeases: a database at migration 00004
// whose leases an older process holds (one held, one ended long ago) is
// upgraded by migration 00005 (the floor of reaped keys) while they are
// held. The migration changes no row and starts the floor at 0. After it
// the held lease renews and is never reaped, the ended key is reaped, and
// granted again above its old token; an older process's acquire, which
// inserts token 1 for a key without a row, then fails closed, for the
// reaped key and for any new one; and a plain DELETE by the application is
// still refused.
func TestSQLiteUpgradeToReapingKeepsLeases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn, err := sqlite.DSN(filepath.Join(t.TempDir(), "u.db"), sqlite.Options{})
	require.NoError(t, err)
	db, err := sql.Open("sqlite", dsn)
	require.NoError(t, err)
	defer db.Close()
	db.SetMaxOpenConns(1)
	p, err := migrations.NewProvider(migrations.SQLite, db, migrations.Options{})
	require.NoError(t, err)
	_, err = p.UpTo(ctx, 4)
	require.NoError(t, err)

	old := oldSQLite{t, db}
	tokH := old.acquire("held", time.Hour, "old-h", nil)
	var tokE int64
	for range 3 {
		tokE = old.acquire("ended", time.Hour, "old-e", nil)
		old.release("ended", tokE, "old-e")
		_, err = db.Exec(`UPDATE sqllock_locks SET deadline = deadline - 7200000 WHERE key = 'ended'`)
		require.NoError(t, err)
	}
	require.EqualValues(t, 3, tokE)
	before := lockRows(t, db)

	require.NoError(t, migrations.Up(ctx, migrations.SQLite, db, migrations.Options{}))
	require.Equal(t, before, lockRows(t, db), "the migration changed a lease")
	var floor int64
	require.NoError(t, db.QueryRow(`SELECT floor FROM sqllock_locks_floor`).Scan(&floor))
	require.Zero(t, floor, "no row was ever deleted before reaping")

	b, err := sqlite.New(db, sqlite.Options{})
	require.NoError(t, err)
	defer b.Close()
	heldH := sqllock.Lease{Key: "held", Token: tokH, Owner: "old-h"}
	_, err = b.TryRenew(ctx, heldH, time.Hour)
	require.NoError(t, err, "the lease held across the upgrade renews")

	for _, stmt := range []string{`DELETE FROM sqllock_locks`, `DELETE FROM sqllock_locks WHERE key = 'ended'`} {
		_, err = db.Exec(stmt)
		require.ErrorContains(t, err, "never deleted", "%s by the application", stmt)
	}
	require.Equal(t, 2, len(lockRows(t, db)))

	n, err := b.Reap(ctx, time.Hour-time.Minute, 100)
	require.NoError(t, err)
	require.Equal(t, 1, n, "the key that ended an hour ago, not the held one")
	require.Equal(t, "held", lockRows(t, db)[0].Key)
	require.Len(t, lockRows(t, db), 1)
	require.NoError(t, db.QueryRow(`SELECT floor FROM sqllock_locks_floor`).Scan(&floor))
	require.Equal(t, tokE, floor)

	// An older process inserts token 1 for a key without a row: refused,
	// for the reaped key and for a new one, writing nothing.
	for _, key := range []string{"ended", "brand-new"} {
		var token, deadline, now int64
		var held bool
		var owner string
		var v []byte
		err := db.QueryRow(old.render(oldAcquire), key, int64(60000), "old-late", nil).Scan(&token, &held, &deadline, &owner, &v, &now)
		require.ErrorContains(t, err, "never goes backwards", "an older acquire of %q after a reap", key)
	}
	require.Len(t, lockRows(t, db), 1)

	l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "ended", TTL: time.Minute, Owner: "new"})
	require.NoError(t, err)
	require.Greater(t, l.Token, tokE, "a reaped key continues above every token it had")
	_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "held", TTL: time.Minute, Owner: "new"})
	require.ErrorIs(t, err, sqllock.ErrNotAcquired)
}
