package migrations_test

import (
	"context"
	"database/sql"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/dialect/sqlite"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// The acquire and renew of the release before SQLite's migrations 00005
// (the floor of reaped keys) and 00006 (shared locks), as that release
// sent them on the default table.
const (
	pre5Acquire = `INSERT INTO "sqllock_locks" (key, token, held, deadline, owner, value, hold_until)
VALUES (?1, coalesce((SELECT token FROM "sqllock_locks" WHERE key = ?1), 1), 1, {{now}} + max(?2, ?5), ?3, ?4, CASE WHEN ?5 > 0 THEN {{now}} + ?5 END)
ON CONFLICT (key) DO UPDATE SET
	token    = token + {{tenure}},
	held     = CASE WHEN {{grant}} THEN 1 ELSE held END,
	deadline = CASE WHEN {{grant}} THEN max(excluded.deadline, CASE WHEN owner = excluded.owner THEN coalesce(hold_until, 0) ELSE 0 END) ELSE deadline END,
	hold_until = CASE WHEN {{tenure}} THEN excluded.hold_until ELSE hold_until END,
	owner    = CASE WHEN {{grant}} THEN excluded.owner ELSE owner END,
	value    = CASE WHEN {{grant}} THEN excluded.value ELSE value END
RETURNING token, held, deadline, owner, {{now}}`
	pre5Tenure = `((deadline <= {{now}} OR (NOT held AND coalesce(hold_until, 0) <= {{now}})) AND token < 9223372036854775807)`
	pre5Grant  = `({{tenure}} OR (held AND deadline > {{now}} AND owner = excluded.owner))`
	pre5Renew  = `UPDATE "sqllock_locks" SET deadline = CASE
	WHEN token = ?2 AND held AND deadline > {{now}} THEN max({{now}} + ?3, coalesce(hold_until, 0))
	ELSE deadline END
WHERE key = ?1
RETURNING token, held, deadline, {{now}}`
)

func pre5(q string) string {
	q = strings.ReplaceAll(q, "{{grant}}", pre5Grant)
	q = strings.ReplaceAll(q, "{{tenure}}", pre5Tenure)
	return strings.ReplaceAll(q, "{{now}}", oldNowMS)
}

// pre5Try tries key for owner with the old acquire and reports whether
// it was granted.
func pre5Try(t *testing.T, db *sql.DB, key, owner string) bool {
	t.Helper()
	var token, deadline, now int64
	var held bool
	var got string
	require.NoError(t, db.QueryRow(pre5(pre5Acquire), key, time.Hour.Milliseconds(), owner, nil, 0).Scan(&token, &held, &deadline, &got, &now))
	return held && got == owner && deadline > now
}

// TestSQLiteUpgradeToSharedKeepsLeases: a database at migration 00004
// whose lease a process of the previous release holds (and renews across
// the upgrade) is upgraded by migrations 00005 and 00006 (the floor of reaped keys,
// shared locks). Before them, this release
// refuses every acquire with ErrSchemaMissing, writing nothing. The
// migration changes no row, the lease
// stays its holder's, refused to readers and writers, and its old renewal
// still works. After the upgrade the old acquire fails closed on a key
// held shared: it never grants it beside a reader, whatever it knows of
// readers, and once its holder released, the key is read with a token
// above the old holder's.
func TestSQLiteUpgradeToSharedKeepsLeases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn, err := sqlite.DSN(filepath.Join(t.TempDir(), "u.db"), sqlite.Options{})
	require.NoError(t, err)
	db, err := sql.Open("sqlite", dsn)
	require.NoError(t, err)
	defer db.Close()
	p, err := migrations.NewProvider(migrations.SQLite, db, migrations.Options{})
	require.NoError(t, err)
	_, err = p.UpTo(ctx, 4)
	require.NoError(t, err)

	require.True(t, pre5Try(t, db, "a", "old-a"))
	before := lockRows(t, db)

	// This release on the table before 00006 refuses, writing nothing,
	// rather than grant without the columns it reads.
	pre, err := sqlite.New(db, sqlite.Options{})
	require.NoError(t, err)
	defer pre.Close()
	for _, req := range []sqllock.AcquireRequest{
		{Key: "n", TTL: time.Minute, Owner: "o"},
		{Key: "n", TTL: time.Minute, Owner: "o", Shared: true},
	} {
		_, err = pre.TryAcquire(ctx, req)
		require.ErrorIs(t, err, sqllock.ErrSchemaMissing, "shared=%v on a table before 00006", req.Shared)
		require.Contains(t, err.Error(), "sqllock migrate up")
	}
	require.Equal(t, before, lockRows(t, db), "the refused acquires wrote nothing")
	require.NoError(t, migrations.Up(ctx, migrations.SQLite, db, migrations.Options{}))
	require.Equal(t, before, lockRows(t, db), "the migration changed a lease")

	b, err := sqlite.New(db, sqlite.Options{})
	require.NoError(t, err)
	defer b.Close()
	var tokA, deadline, now int64
	var held bool
	require.NoError(t, db.QueryRow(pre5(pre5Renew), "a", before[0].Token, time.Hour.Milliseconds()).Scan(&tokA, &held, &deadline, &now))
	require.True(t, held && tokA == before[0].Token && deadline > now, "the old renewal after the upgrade")
	_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "a", TTL: time.Minute, Owner: "r", Shared: true})
	var he *sqllock.HeldError
	require.ErrorAs(t, err, &he)
	require.Equal(t, "old-a", he.Owner)

	// Readers on "s": the old acquire is refused beside them.
	r1, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "s", TTL: time.Minute, Owner: "r1", Shared: true})
	require.NoError(t, err)
	r2, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "s", TTL: time.Minute, Owner: "r2", Shared: true})
	require.NoError(t, err)
	require.False(t, pre5Try(t, db, "s", "old-w"), "the old acquire granted a key held shared")
	require.NoError(t, b.Release(ctx, r1))
	require.False(t, pre5Try(t, db, "s", "old-w"), "the old acquire granted a key beside its last reader")
	require.NoError(t, b.Release(ctx, r2))
	require.True(t, pre5Try(t, db, "s", "old-w"), "the old acquire of a key its readers left")
	i := listedOne(t, b, "s")
	require.Greater(t, i.Token, r2.Token)

	// The old holder of "a" releases; the key is read above its token.
	_, err = db.Exec(`UPDATE sqllock_locks SET held = 0 WHERE key = 'a'`)
	require.NoError(t, err)
	r3, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "a", TTL: time.Minute, Owner: "r3", Shared: true})
	require.NoError(t, err)
	require.Greater(t, r3.Token, tokA)
}
