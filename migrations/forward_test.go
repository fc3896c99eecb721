package migrations_test

import (
	"context"
	"database/sql"
	"errors"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"

	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/migrations"
)

// latest is the number of d's migrations, which is the latest version.
func latest(t *testing.T, d migrations.Dialect) int {
	t.Helper()
	fsys, err := migrations.FS(d, migrations.Options{})
	require.NoError(t, err)
	names, err := fs.Glob(fsys, "*.sql")
	require.NoError(t, err)
	return len(names)
}

// downAll rolls back every applied migration, one step at a time.
func downAll(t *testing.T, d migrations.Dialect, db *sql.DB, o migrations.Options) {
	t.Helper()
	for range latest(t, d) + 1 {
		err := migrations.Down(context.Background(), d, db, o)
		if errors.Is(err, goose.ErrNoNextVersion) {
			return
		}
		require.NoError(t, err)
	}
	t.Fatalf("migrations still applied after %d steps down", latest(t, d)+1)
}

// upTo applies d's migrations up to version on db.
func upTo(t *testing.T, d migrations.Dialect, db *sql.DB, o migrations.Options, version int64) {
	t.Helper()
	p, err := migrations.NewProvider(d, db, o)
	require.NoError(t, err)
	_, err = p.UpTo(context.Background(), version)
	require.NoError(t, err)
}

// TestSQLiteTokensNeverGoBackwards (issue: the token history must never go
// backwards): a database created by migration 00001 with leases in it is
// upgraded; the leases survive, held, with their tokens; then every way to
// lower a token by hand is refused (REPLACE INTO and INSERT OR REPLACE
// delete the row without firing DELETE triggers, so 00001's trigger does
// not see them), while raising one, and ashlock's own statements, still
// work.
func TestSQLiteTokensNeverGoBackwards(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	db, err := sql.Open("sqlite", filepath.Join(t.TempDir(), "up.db"))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	upTo(t, migrations.SQLite, db, migrations.Options{}, 1)
	_, err = db.Exec(`INSERT INTO sqllock_locks (key, token, held, deadline, owner) VALUES
		('a', 7, 1, 9999999999999, 'holder-a'), ('b', 3, 0, 1, 'holder-b')`)
	require.NoError(t, err)

	require.NoError(t, migrations.Up(ctx, migrations.SQLite, db, migrations.Options{}))
	rows := func() map[string][2]int64 {
		r, err := db.Query(`SELECT key, token, held FROM sqllock_locks ORDER BY key`)
		require.NoError(t, err)
		defer r.Close()
		out := map[string][2]int64{}
		for r.Next() {
			var k string
			var tok, held int64
			require.NoError(t, r.Scan(&k, &tok, &held))
			out[k] = [2]int64{tok, held}
		}
		require.NoError(t, r.Err())
		return out
	}
	before := map[string][2]int64{"a": {7, 1}, "b": {3, 0}}
	require.Equal(t, before, rows(), "the upgrade keeps every lease as it was")

	for _, stmt := range []string{
		`UPDATE sqllock_locks SET token = 1 WHERE key = 'a'`,
		`UPDATE sqllock_locks SET token = token - 1`,
		`UPDATE sqllock_locks SET key = 'c' WHERE key = 'b'`,
		`REPLACE INTO sqllock_locks (key, token, held, deadline, owner) VALUES ('a', 1, 0, 1, 'x')`,
		`INSERT OR REPLACE INTO sqllock_locks (key, token, held, deadline, owner) VALUES ('b', 2, 0, 1, 'x')`,
		`INSERT INTO sqllock_locks (key, token, held, deadline, owner) VALUES ('a', 1, 0, 1, 'x')
		 ON CONFLICT (key) DO UPDATE SET token = excluded.token`,
	} {
		_, err := db.Exec(stmt)
		require.ErrorContains(t, err, "never goes backwards", stmt)
		require.Equal(t, before, rows(), "after %s", stmt)
	}

	// Keeping or raising a token is allowed, and so is a new key.
	_, err = db.Exec(`UPDATE sqllock_locks SET token = token + 1, held = 1 WHERE key = 'b'`)
	require.NoError(t, err)
	_, err = db.Exec(`REPLACE INTO sqllock_locks (key, token, held, deadline, owner) VALUES ('b', 4, 0, 1, 'x')`)
	require.NoError(t, err)
	_, err = db.Exec(`INSERT INTO sqllock_locks (key, token, held, deadline, owner) VALUES ('n', 1, 0, 1, 'x')`)
	require.NoError(t, err)
	require.Equal(t, map[string][2]int64{"a": {7, 1}, "b": {4, 0}, "n": {1, 0}}, rows())

	// Down to 00001 removes both triggers again (00001's stays).
	p, err := migrations.NewProvider(migrations.SQLite, db, migrations.Options{})
	require.NoError(t, err)
	_, err = p.DownTo(ctx, 1)
	require.NoError(t, err)
	var triggers int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM sqlite_master WHERE type = 'trigger'`).Scan(&triggers))
	require.Equal(t, 1, triggers)
}

// `sqllock migrate sql` (migrations.SQL) shows migration 00002, up and down.
func TestSQLShowsTokensForward(t *testing.T) {
	t.Parallel()
	for _, d := range []migrations.Dialect{migrations.Postgres, migrations.SQLite} {
		up, err := migrations.SQL(d, migrations.Options{}, migrations.DirectionUp)
		require.NoError(t, err)
		require.Contains(t, up, "migration 00002_tokens_forward.sql (version 2), up\n", d)
		require.Contains(t, up, `"sqllock_locks_forward"`, d)
		down, err := migrations.SQL(d, migrations.Options{}, migrations.DirectionDown)
		require.NoError(t, err)
		require.Contains(t, down, "migration 00002_tokens_forward.sql (version 2), down\n", d)
		require.Less(t, strings.Index(down, "(version 2)"), strings.Index(down, "(version 1)"), "%s: down runs 00002 first", d)
	}
}

func TestSQLUnknownDirection(t *testing.T) {
	t.Parallel()
	_, err := migrations.SQL(migrations.SQLite, migrations.Options{}, "sideways")
	require.ErrorIs(t, err, migrations.ErrUnknownDirection)
}
