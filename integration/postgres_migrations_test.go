package integration

import (
	"context"
	"database/sql"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/dialect/postgres"
	"github.com/ashlock/ashlock/internal/testkit/pgtest"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// The migrations on a real PostgreSQL (issue "PostgreSQL backend", item 4):
// apply, roll back and re-apply; the SQL that `sqllock migrate sql` prints
// builds the same table as Up; hostile names never reach the server.

// migSchema registers a schema name that does not exist yet (Up or the
// rendered script creates it), dropped with everything in it at the end of
// the test unless the test failed.
func migSchema(t *testing.T, db *pgtest.DB, suffix string) string {
	t.Helper()
	name := db.Schema + "_" + suffix
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("kept schema %s", name)
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, err := db.Pool.Exec(ctx, "DROP SCHEMA IF EXISTS "+pgx.Identifier{name}.Sanitize()+" CASCADE")
		require.NoError(t, err)
	})
	return name
}

// migTableExists reports whether schema.table exists.
func migTableExists(ctx context.Context, t *testing.T, pool *pgxpool.Pool, schema, table string) bool {
	t.Helper()
	var exists bool
	require.NoError(t, pool.QueryRow(ctx, "SELECT to_regclass(format('%I.%I', $1::text, $2::text)) IS NOT NULL", schema, table).Scan(&exists))
	return exists
}

// migAcquireOnce takes key through a fresh Client on be, releases it and
// returns its token.
func migAcquireOnce(ctx context.Context, t *testing.T, be sqllock.Backend, key string) int64 {
	t.Helper()
	c, err := sqllock.New(be, sqllock.Options{Owner: "migrations-test", TTL: 10 * time.Second})
	require.NoError(t, err)
	defer func() { require.NoError(t, c.Close(ctx)) }()
	g, err := c.TryAcquire(ctx, key, nil)
	require.NoError(t, err)
	require.NoError(t, g.Release(ctx))
	return g.Token()
}

// TestPostgresMigrationsUpDownUp applies the migrations to a schema that
// does not exist yet, rolls them back and applies them again, with the
// backend working before and after.
func TestPostgresMigrationsUpDownUp(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	schema := migSchema(t, db, "up")
	opts := migrations.Options{Schema: schema}
	sqlDB := stdlib.OpenDBFromPool(db.Pool)
	defer func() { require.NoError(t, sqlDB.Close()) }()

	be, err := postgres.New(db.Pool, postgres.Options{Schema: schema})
	require.NoError(t, err)
	defer func() { require.NoError(t, be.Close()) }()

	requireApplied := func(want bool) {
		t.Helper()
		st, err := migrations.Status(ctx, migrations.Postgres, sqlDB, opts)
		require.NoError(t, err)
		require.NotEmpty(t, st)
		for _, s := range st {
			require.Equal(t, want, s.State == "applied", "migration %s: state %s", s.Source.Path, s.State)
		}
		require.Equal(t, want, migTableExists(ctx, t, db.Pool, schema, migrations.DefaultTable))
	}

	// Before: no schema, so the backend reports the table missing.
	_, err = be.List(ctx, "")
	require.ErrorIs(t, err, sqllock.ErrSchemaMissing)

	require.NoError(t, migrations.Up(ctx, migrations.Postgres, sqlDB, opts))
	requireApplied(true)
	require.NoError(t, migrations.Up(ctx, migrations.Postgres, sqlDB, opts), "a second Up is a no-op")
	require.Equal(t, int64(1), migAcquireOnce(ctx, t, be, "k"))
	require.Equal(t, int64(2), migAcquireOnce(ctx, t, be, "k"))
	require.Equal(t, int64(3), migAcquireOnce(ctx, t, be, "k"))

	// Rows are the token history: deleting by hand is refused
	// (docs/pitfalls.md#19), so a key cannot start over at token 1 behind a stale holder.
	table := pgx.Identifier{schema, migrations.DefaultTable}.Sanitize()
	for _, stmt := range []string{"DELETE FROM " + table, "DELETE FROM " + table + " WHERE key = 'k'", "TRUNCATE " + table} {
		_, err := db.Pool.Exec(ctx, stmt)
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr, stmt)
		require.Equal(t, "23001", pgErr.Code, stmt)
		require.Contains(t, pgErr.Message, "never deleted", stmt)
		require.Contains(t, pgErr.Hint, "sqllock release --force", stmt)
	}
	require.Equal(t, int64(4), migAcquireOnce(ctx, t, be, "k"), "the token history survived")

	migDownAll(ctx, t, sqlDB, opts)
	requireApplied(false)
	for _, fn := range []string{"_keep", "_forward"} {
		var left bool
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace
			WHERE n.nspname = $1 AND p.proname = $2)`, schema, migrations.DefaultTable+fn).Scan(&left))
		require.False(t, left, "Down leaves the trigger function %s behind", fn)
	}
	var schemaLeft bool
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = $1)", schema).Scan(&schemaLeft))
	require.True(t, schemaLeft, "Down leaves the schema in place")
	_, err = be.List(ctx, "")
	require.ErrorIs(t, err, sqllock.ErrSchemaMissing, "after Down the backend reports the table missing")
	_, err = be.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Second, Owner: "o"})
	require.ErrorIs(t, err, sqllock.ErrSchemaMissing)
	require.ErrorContains(t, err, "migrate up")

	require.NoError(t, migrations.Up(ctx, migrations.Postgres, sqlDB, opts))
	requireApplied(true)
	// Down dropped the table and with it the token history, so tokens
	// restart at 1 (migrations.Down and the down migration say so: it is
	// for uninstalling only). This is the one way to break G2, and it takes
	// an explicit rollback of the schema.
	require.Equal(t, int64(1), migAcquireOnce(ctx, t, be, "k"))
	require.Equal(t, int64(2), migAcquireOnce(ctx, t, be, "k"))
	infos, err := be.List(ctx, "")
	require.NoError(t, err)
	require.Len(t, infos, 1)
	require.Equal(t, int64(2), infos[0].Token)
	require.False(t, infos[0].Held)
}

// migDownAll rolls back every applied migration, one step at a time, as
// `sqllock migrate down --force` does when repeated.
func migDownAll(ctx context.Context, t *testing.T, sqlDB *sql.DB, opts migrations.Options) {
	t.Helper()
	for range 10 {
		err := migrations.Down(ctx, migrations.Postgres, sqlDB, opts)
		if errors.Is(err, goose.ErrNoNextVersion) {
			return
		}
		require.NoError(t, err)
	}
	t.Fatal("migrations still applied after 10 steps down")
}

// TestPostgresMigrationsTokensNeverGoBackwards (issue: the token history
// must never go backwards): a schema created by migration 00001 with leases
// in it is upgraded; the leases survive, held, with their tokens. Then every
// way to lower a token (or rename a key) by hand is refused, while raising
// one and ashlock's own statements still work.
func TestPostgresMigrationsTokensNeverGoBackwards(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	schema := migSchema(t, db, "fwd")
	opts := migrations.Options{Schema: schema}
	sqlDB := stdlib.OpenDBFromPool(db.Pool)
	defer func() { require.NoError(t, sqlDB.Close()) }()
	p, err := migrations.NewProvider(migrations.Postgres, sqlDB, opts)
	require.NoError(t, err)
	_, err = p.UpTo(ctx, 1)
	require.NoError(t, err)

	be, err := postgres.New(db.Pool, postgres.Options{Schema: schema})
	require.NoError(t, err)
	defer func() { require.NoError(t, be.Close()) }()
	held, err := be.TryAcquire(ctx, sqllock.AcquireRequest{Key: "a", TTL: time.Hour, Owner: "holder-a"})
	require.NoError(t, err)
	for range 3 {
		migAcquireOnce(ctx, t, be, "b") // b: token 3, released
	}

	table := pgx.Identifier{schema, migrations.DefaultTable}.Sanitize()
	rows := func() map[string]string {
		r, err := db.Pool.Query(ctx, "SELECT key, format('%s/%s/%s', token, held, owner) FROM "+table)
		require.NoError(t, err)
		out := map[string]string{}
		var k, v string
		_, err = pgx.ForEachRow(r, []any{&k, &v}, func() error { out[k] = v; return nil })
		require.NoError(t, err)
		return out
	}
	before := rows()
	require.Equal(t, "1/t/holder-a", before["a"])

	require.NoError(t, migrations.Up(ctx, migrations.Postgres, sqlDB, opts))
	require.Equal(t, before, rows(), "the upgrade keeps every lease as it was")
	_, err = be.TryRenew(ctx, held, time.Hour)
	require.NoError(t, err, "the held lease is still held after the upgrade")

	for _, stmt := range []string{
		"UPDATE " + table + " SET token = 1 WHERE key = 'b'",
		"UPDATE " + table + " SET token = token - 1",
		"UPDATE " + table + " SET key = 'c' WHERE key = 'b'",
		"INSERT INTO " + table + " (key, token, held, deadline, owner) VALUES ('b', 1, false, now(), 'x') ON CONFLICT (key) DO UPDATE SET token = excluded.token",
	} {
		_, err := db.Pool.Exec(ctx, stmt)
		var pgErr *pgconn.PgError
		require.ErrorAs(t, err, &pgErr, stmt)
		require.Equal(t, "23001", pgErr.Code, stmt)
		require.Contains(t, pgErr.Message, "never", stmt)
		require.Equal(t, before, rows(), "after %s", stmt)
	}
	_, err = db.Pool.Exec(ctx, "UPDATE "+table+" SET token = token + 10 WHERE key = 'b'")
	require.NoError(t, err, "raising a token is allowed")
	require.Equal(t, int64(14), migAcquireOnce(ctx, t, be, "b"), "grants go on from the raised token")
	require.NoError(t, be.Release(ctx, held))

	up, err := migrations.SQL(migrations.Postgres, opts, "up")
	require.NoError(t, err)
	require.Contains(t, up, "sqllock_tokens_forward", "`sqllock migrate sql` shows the trigger")
}

// migTableShape describes a table as the catalogs do, with the schema name
// taken out, so that two schemas' tables compare equal when they have the
// same definition.
func migTableShape(ctx context.Context, t *testing.T, pool *pgxpool.Pool, schema, table string) []string {
	t.Helper()
	var shape []string
	add := func(q string) {
		rows, err := pool.Query(ctx, q, schema, table)
		require.NoError(t, err)
		lines, err := pgx.CollectRows(rows, pgx.RowTo[string])
		require.NoError(t, err)
		for _, l := range lines {
			shape = append(shape, strings.ReplaceAll(l, schema, "<schema>"))
		}
	}
	add(`SELECT format('column %s %s: %s nullable=%s default=%s',
			ordinal_position, column_name, data_type, is_nullable, coalesce(column_default, '-'))
		FROM information_schema.columns WHERE table_schema = $1 AND table_name = $2
		ORDER BY ordinal_position`)
	add(`SELECT format('attribute %s: %s notnull=%s', a.attname, format_type(a.atttypid, a.atttypmod), a.attnotnull)
		FROM pg_attribute a JOIN pg_class c ON c.oid = a.attrelid JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = $1 AND c.relname = $2 AND a.attnum > 0 AND NOT a.attisdropped
		ORDER BY a.attnum`)
	add(`SELECT format('constraint %s %s: %s', co.conname, co.contype, pg_get_constraintdef(co.oid))
		FROM pg_constraint co JOIN pg_class c ON c.oid = co.conrelid JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = $1 AND c.relname = $2
		ORDER BY co.conname`)
	add(`SELECT format('index %s', indexdef) FROM pg_indexes
		WHERE schemaname = $1 AND tablename = $2 ORDER BY indexname`)
	add(`SELECT format('relation kind=%s persistence=%s options=%s', c.relkind, c.relpersistence, coalesce(c.reloptions::text, '-'))
		FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = $1 AND c.relname = $2`)
	add(`SELECT format('trigger %s', tgname) FROM pg_trigger tg JOIN pg_class c ON c.oid = tg.tgrelid
		JOIN pg_namespace n ON n.oid = c.relnamespace
		WHERE n.nspname = $1 AND c.relname = $2 AND NOT tg.tgisinternal ORDER BY tgname`)
	return shape
}

// TestPostgresMigrationsRenderedSQL applies the SQL that migrations.SQL
// renders (what `sqllock migrate sql` prints, for teams with their own
// schema tool) by hand, in one Exec, and checks that it builds the same
// table as migrations.Up: columns, types, nullability, defaults,
// constraints, indexes, and a logged (never unlogged) table. Its down
// script removes the table again.
func TestPostgresMigrationsRenderedSQL(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	upSchema, sqlSchema := migSchema(t, db, "up"), migSchema(t, db, "sql")
	sqlDB := stdlib.OpenDBFromPool(db.Pool)
	defer func() { require.NoError(t, sqlDB.Close()) }()

	require.NoError(t, migrations.Up(ctx, migrations.Postgres, sqlDB, migrations.Options{Schema: upSchema}))

	up, err := migrations.SQL(migrations.Postgres, migrations.Options{Schema: sqlSchema}, "up")
	require.NoError(t, err)
	require.Contains(t, up, pgx.Identifier{sqlSchema, migrations.DefaultTable}.Sanitize())
	_, err = db.Pool.Exec(ctx, up)
	require.NoError(t, err, "the rendered up script:\n%s", up)
	require.False(t, migTableExists(ctx, t, db.Pool, sqlSchema, migrations.DefaultTable+"_version"),
		"the rendered script does not create goose's version table")

	want := migTableShape(ctx, t, db.Pool, upSchema, migrations.DefaultTable)
	got := migTableShape(ctx, t, db.Pool, sqlSchema, migrations.DefaultTable)
	t.Logf("table built by migrations.Up:\n\t%s", strings.Join(want, "\n\t"))
	require.Contains(t, want, "relation kind=r persistence=p options=-",
		"the lock table must be logged: an unlogged table is emptied after a crash, and the token history with it")
	for _, col := range []string{"key", "token", "held", "deadline", "owner"} {
		found := false
		for _, l := range want {
			found = found || strings.HasPrefix(l, "attribute "+col+":") && strings.HasSuffix(l, "notnull=t")
		}
		require.True(t, found, "column %s missing or nullable", col)
	}
	require.Equal(t, want, got, "the rendered SQL builds a different table than migrations.Up")

	// The backend works on the hand-built table.
	be, err := postgres.New(db.Pool, postgres.Options{Schema: sqlSchema})
	require.NoError(t, err)
	defer func() { require.NoError(t, be.Close()) }()
	require.Equal(t, int64(1), migAcquireOnce(ctx, t, be, "k"))
	require.Equal(t, int64(2), migAcquireOnce(ctx, t, be, "k"))

	down, err := migrations.SQL(migrations.Postgres, migrations.Options{Schema: sqlSchema}, "down")
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, down)
	require.NoError(t, err, "the rendered down script:\n%s", down)
	require.False(t, migTableExists(ctx, t, db.Pool, sqlSchema, migrations.DefaultTable))
	require.True(t, migTableExists(ctx, t, db.Pool, upSchema, migrations.DefaultTable), "only the named schema's table is dropped")
}

// TestPostgresMigrationsHostileIdentifiers passes a table and a schema
// name that would run `DROP TABLE y` if pasted into SQL. Every entry point
// refuses them with ErrInvalidIdentifier before any I/O (shown with a
// closed *sql.DB, whose first use would fail differently), postgres.New
// refuses them too, and the sentinel table y is intact.
func TestPostgresMigrationsHostileIdentifiers(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	_, err := db.Pool.Exec(ctx, "CREATE TABLE y (v int NOT NULL); INSERT INTO y VALUES (42)")
	require.NoError(t, err)

	const hostileTable = `x"; DROP TABLE y; --`
	hostileSchema := db.Schema + `"; DROP TABLE y; --`
	cases := []migrations.Options{
		{Schema: db.Schema, Table: hostileTable},
		{Table: hostileTable},
		{Schema: hostileSchema},
		{Schema: hostileSchema, Table: hostileTable},
	}

	open := stdlib.OpenDBFromPool(db.Pool)
	defer func() { require.NoError(t, open.Close()) }()
	closed := stdlib.OpenDBFromPool(db.Pool)
	require.NoError(t, closed.Close())
	_, err = closed.ExecContext(ctx, "SELECT 1")
	const closedMsg = "sql: database is closed"
	require.ErrorContains(t, err, closedMsg, "a closed *sql.DB fails on any I/O")

	for _, o := range cases {
		for _, sqlDB := range []*sql.DB{open, closed} {
			steps := map[string]error{
				"Up":   migrations.Up(ctx, migrations.Postgres, sqlDB, o),
				"Down": migrations.Down(ctx, migrations.Postgres, sqlDB, o),
			}
			_, steps["Status"] = migrations.Status(ctx, migrations.Postgres, sqlDB, o)
			_, steps["NewProvider"] = migrations.NewProvider(migrations.Postgres, sqlDB, o)
			for name, err := range steps {
				require.ErrorIs(t, err, migrations.ErrInvalidIdentifier, "%s with %+v", name, o)
				require.NotContains(t, err.Error(), closedMsg, "%s with %+v did I/O", name, o)
			}
		}
		for _, dir := range []migrations.Direction{migrations.DirectionUp, migrations.DirectionDown} {
			s, err := migrations.SQL(migrations.Postgres, o, dir)
			require.ErrorIs(t, err, migrations.ErrInvalidIdentifier, "SQL %s with %+v", dir, o)
			require.Empty(t, s)
		}
		_, err := migrations.FS(migrations.Postgres, o)
		require.ErrorIs(t, err, migrations.ErrInvalidIdentifier, "FS with %+v", o)

		be, err := postgres.New(db.Pool, postgres.Options{Schema: o.Schema, Table: o.Table})
		require.ErrorIs(t, err, migrations.ErrInvalidIdentifier, "postgres.New with %+v", o)
		require.Nil(t, be)
	}

	var v int
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT v FROM y").Scan(&v), "the sentinel table y must survive")
	require.Equal(t, 42, v)
	rows, err := db.Pool.Query(ctx, "SELECT tablename FROM pg_tables WHERE schemaname = $1 ORDER BY 1", db.Schema)
	require.NoError(t, err)
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	require.NoError(t, err)
	require.Equal(t, []string{"y"}, tables, "nothing was created in the schema")
	var schemas int
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_namespace WHERE nspname LIKE $1", db.Schema+"%").Scan(&schemas))
	require.Equal(t, 1, schemas, "no schema was created")
	t.Logf("%d hostile option sets refused by Up, Down, Status, NewProvider, SQL, FS and postgres.New; sentinel intact", len(cases))
}
