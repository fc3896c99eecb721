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

// The statements of the release before SQLite's migration 00004
// (hold_until), as that release sent them: a process of it that still
// runs during the upgrade holds, renews and releases its leases with
// these.
const (
	oldNowMS   = `CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER)`
	oldGrant   = `(((NOT held OR deadline <= {{now}}) AND token < 9223372036854775807) OR (held AND deadline > {{now}} AND owner = excluded.owner))`
	oldAcquire = `
INSERT INTO {{table}} (key, token, held, deadline, owner, value)
VALUES (?1, coalesce((SELECT token FROM {{table}} WHERE key = ?1), 1), 1, {{now}} + ?2, ?3, ?4)
ON CONFLICT (key) DO UPDATE SET
	token    = token + ((NOT held OR deadline <= {{now}}) AND token < 9223372036854775807),
	held     = CASE WHEN {{grant}} THEN 1 ELSE held END,
	deadline = CASE WHEN {{grant}} THEN excluded.deadline ELSE deadline END,
	owner    = CASE WHEN {{grant}} THEN excluded.owner ELSE owner END,
	value    = CASE WHEN {{grant}} THEN excluded.value ELSE value END
RETURNING token, held, deadline, owner, value, {{now}}`
	oldRenew = `
UPDATE {{table}} SET deadline = CASE
	WHEN token = ?2 AND held AND deadline > {{now}} THEN {{now}} + ?3
	ELSE deadline END
WHERE key = ?1
RETURNING token, held, deadline, {{now}}`
	oldRelease = `
UPDATE {{table}} SET held = 0, owner = ?3
WHERE key = ?1 AND token = ?2 AND held
RETURNING deadline, {{now}}`
)

// oldSQLite is a process of the release before 00004 on db's default
// table.
type oldSQLite struct {
	t  *testing.T
	db *sql.DB
}

func (o oldSQLite) render(q string) string {
	q = strings.ReplaceAll(q, "{{grant}}", oldGrant)
	q = strings.ReplaceAll(q, "{{now}}", oldNowMS)
	return strings.ReplaceAll(q, "{{table}}", `"sqllock_locks"`)
}

// acquire grants key to owner for ttl, as the old release did, and
// returns the token; it fails t if the key was not granted.
func (o oldSQLite) acquire(key string, ttl time.Duration, owner string, value []byte) int64 {
	o.t.Helper()
	var token, deadline, now int64
	var held bool
	var got string
	var v []byte
	err := o.db.QueryRow(o.render(oldAcquire), key, ttl.Milliseconds(), owner, value).Scan(&token, &held, &deadline, &got, &v, &now)
	require.NoError(o.t, err)
	require.True(o.t, held && got == owner && deadline > now, "the old acquire of %q was not granted", key)
	return token
}

// renew renews key's lease of token for ttl, as the old release did, and
// returns the new deadline (Unix ms); it fails t if the lease was lost.
func (o oldSQLite) renew(key string, token int64, ttl time.Duration) int64 {
	o.t.Helper()
	var got, deadline, now int64
	var held bool
	require.NoError(o.t, o.db.QueryRow(o.render(oldRenew), key, token, ttl.Milliseconds()).Scan(&got, &held, &deadline, &now))
	require.True(o.t, got == token && held && deadline > now, "the old renewal of %q token %d failed", key, token)
	return deadline
}

// release releases key's lease of token, as the old release did; it fails
// t if nothing was released.
func (o oldSQLite) release(key string, token int64, owner string) {
	o.t.Helper()
	var deadline, now int64
	require.NoError(o.t, o.db.QueryRow(o.render(oldRelease), key, token, owner).Scan(&deadline, &now))
}

// lockRow is a row of the lock table without hold_until.
type lockRow struct {
	Key      string
	Token    int64
	Held     bool
	Deadline int64
	Owner    string
	Value    []byte
}

func lockRows(t *testing.T, db *sql.DB) []lockRow {
	t.Helper()
	rows, err := db.Query(`SELECT key, token, held, deadline, owner, value FROM sqllock_locks ORDER BY key`)
	require.NoError(t, err)
	defer rows.Close()
	var out []lockRow
	for rows.Next() {
		var r lockRow
		require.NoError(t, rows.Scan(&r.Key, &r.Token, &r.Held, &r.Deadline, &r.Owner, &r.Value))
		out = append(out, r)
	}
	require.NoError(t, rows.Err())
	return out
}

func listedOne(t *testing.T, b *sqlite.Backend, key string) sqllock.LockInfo {
	t.Helper()
	infos, err := b.List(context.Background(), key)
	require.NoError(t, err)
	for _, i := range infos {
		if i.Key == key {
			return i
		}
	}
	t.Fatalf("List has no %q", key)
	return sqllock.LockInfo{}
}

// TestSQLiteUpgradeToHoldUntilKeepsLeases: a database at migration 00003
// (before hold_until) whose leases a process of the previous release
// holds (a held lease, a released one, an expired one, and one its process
// keeps renewing across the upgrade) is upgraded by migration 00004 while
// they are held. The migration changes no row: every token, holder,
// deadline and value is as it was, hold_until is NULL (no min hold). Before
// it, this release refuses a min hold on the old table (ErrSchemaMissing,
// nothing written) rather than ignore it. After it, the held lease is
// still refused to others, renews, and is released at once (it has no min
// hold); the expired one is taken over with the next token; the old
// process's own renewal and release still work; and a new grant with a
// min hold keeps its key held after its release.
func TestSQLiteUpgradeToHoldUntilKeepsLeases(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dsn, err := sqlite.DSN(filepath.Join(t.TempDir(), "u.db"), sqlite.Options{})
	require.NoError(t, err)
	db, err := sql.Open("sqlite", dsn)
	require.NoError(t, err)
	defer db.Close()
	p, err := migrations.NewProvider(migrations.SQLite, db, migrations.Options{})
	require.NoError(t, err)
	_, err = p.UpTo(ctx, 3)
	require.NoError(t, err)

	old := oldSQLite{t, db}
	tokA := old.acquire("a", time.Hour, "old-a1", nil)
	old.release("a", tokA, "old-a1")
	tokA = old.acquire("a", time.Hour, "old-a", []byte("x"))
	require.EqualValues(t, 2, tokA)
	tokR := old.acquire("r", time.Hour, "old-r", nil)
	old.release("r", tokR, "old-r")
	tokE := old.acquire("e", time.Hour, "old-e", nil)
	_, err = db.Exec(`UPDATE sqllock_locks SET deadline = deadline - 7200000 WHERE key = 'e'`) // expired an hour ago
	require.NoError(t, err)
	tokD := old.acquire("d", time.Minute, "old-d", nil)
	before := lockRows(t, db)
	require.Len(t, before, 4)

	pre, err := sqlite.New(db, sqlite.Options{})
	require.NoError(t, err)
	defer pre.Close()
	_, err = pre.TryAcquire(ctx, sqllock.AcquireRequest{Key: "n", TTL: time.Minute, Owner: "o", MinHold: time.Hour})
	require.ErrorIs(t, err, sqllock.ErrSchemaMissing, "a min hold on a table without hold_until")
	require.Contains(t, err.Error(), "sqllock migrate up")
	require.Equal(t, before, lockRows(t, db), "the refused acquire wrote nothing")

	require.NoError(t, migrations.Up(ctx, migrations.SQLite, db, migrations.Options{}))
	require.Equal(t, before, lockRows(t, db), "the migration changed a lease")
	var withHold int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM sqllock_locks WHERE hold_until IS NOT NULL`).Scan(&withHold))
	require.Zero(t, withHold, "a lease from before the upgrade has no min hold")

	b, err := sqlite.New(db, sqlite.Options{})
	require.NoError(t, err)
	defer b.Close()

	// The held lease: its holder, token, deadline and value, refused to
	// others; it renews (never to an earlier deadline) and, released,
	// frees the key at once.
	i := listedOne(t, b, "a")
	require.True(t, i.Held)
	require.Equal(t, tokA, i.Token)
	require.Equal(t, "old-a", i.Owner)
	require.Equal(t, []byte("x"), i.Value)
	require.Equal(t, before[0].Deadline, i.Deadline.UnixMilli())
	_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "a", TTL: time.Minute, Owner: "new"})
	var he *sqllock.HeldError
	require.ErrorAs(t, err, &he)
	require.Equal(t, tokA, he.Token)
	require.Equal(t, "old-a", he.Owner)
	heldA := sqllock.Lease{Key: "a", Token: tokA, Owner: "old-a"}
	r, err := b.TryRenew(ctx, heldA, 2*time.Hour)
	require.NoError(t, err, "the lease held across the upgrade renews")
	require.Greater(t, r.Deadline.UnixMilli(), before[0].Deadline)
	require.NoError(t, b.Release(ctx, heldA))
	require.False(t, listedOne(t, b, "a").Held, "a lease from before the upgrade has no min hold")
	l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "a", TTL: time.Minute, Owner: "new"})
	require.NoError(t, err)
	require.Equal(t, tokA+1, l.Token)

	// The expired lease is taken over with the next token.
	require.False(t, listedOne(t, b, "e").Held)
	l, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "e", TTL: time.Minute, Owner: "new"})
	require.NoError(t, err)
	require.Equal(t, tokE+1, l.Token)

	// The old process, still running, renews and releases its lease with
	// its own statements, which do not name the new column.
	dl := old.renew("d", tokD, time.Hour)
	require.Greater(t, dl, before[1].Deadline)
	require.Equal(t, dl, listedOne(t, b, "d").Deadline.UnixMilli())
	old.release("d", tokD, "old-d")
	l, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "d", TTL: time.Minute, Owner: "new"})
	require.NoError(t, err)
	require.Equal(t, tokD+1, l.Token)

	// The released key, granted again with a min hold and released
	// inside it, stays held by its holder with its token.
	require.False(t, listedOne(t, b, "r").Held)
	l, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "r", TTL: time.Minute, Owner: "job", MinHold: time.Hour})
	require.NoError(t, err)
	require.Equal(t, tokR+1, l.Token)
	require.NoError(t, b.Release(ctx, l))
	i = listedOne(t, b, "r")
	require.True(t, i.Held, "released inside its min hold after the upgrade")
	require.Equal(t, "job", i.Owner)
	require.Equal(t, l.Token, i.Token)
	_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "r", TTL: time.Minute, Owner: "late"})
	require.ErrorAs(t, err, &he)
	require.Equal(t, "job", he.Owner)
}
