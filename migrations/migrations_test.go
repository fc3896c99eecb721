package migrations_test

import (
	"context"
	"crypto/rand"
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"testing/fstest"
	"time"

	"github.com/jackc/pgx/v5"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"
	_ "modernc.org/sqlite"

	"github.com/ashlock/ashlock/internal/testkit/pgtest"
	"github.com/ashlock/ashlock/migrations"
)

// TestMain stops the shared PostgreSQL server (if pgtest started one) and
// then checks that no goroutine leaked.
func TestMain(m *testing.M) {
	code := pgtest.Main(m)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}

type testBundle struct {
	db *sql.DB
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	db, err := sql.Open("sqlite", filepath.Join(t.TempDir(), "test.db"))
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	return &testBundle{db: db}
}

// tableExists reports whether SQLite has a table with exactly this name.
func tableExists(t *testing.T, db *sql.DB, name string) bool {
	t.Helper()
	var n int
	err := db.QueryRow(`SELECT count(*) FROM sqlite_schema WHERE type = 'table' AND name = ?`, name).Scan(&n)
	require.NoError(t, err)
	return n == 1
}

func TestSQLite(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("UpCreatesTablesAndIsIdempotent", func(t *testing.T) {
		t.Parallel()
		b := setup(t)

		require.NoError(t, migrations.Up(ctx, migrations.SQLite, b.db, migrations.Options{}))
		require.True(t, tableExists(t, b.db, "sqllock_locks"))
		require.True(t, tableExists(t, b.db, "sqllock_locks_version"))
		require.False(t, tableExists(t, b.db, goose.DefaultTablename))

		require.NoError(t, migrations.Up(ctx, migrations.SQLite, b.db, migrations.Options{}))
		var rows int
		require.NoError(t, b.db.QueryRow(`SELECT count(*) FROM sqllock_locks_version WHERE version_id > 0`).Scan(&rows))
		require.Equal(t, latest(t, migrations.SQLite), rows)

		st, err := migrations.Status(ctx, migrations.SQLite, b.db, migrations.Options{})
		require.NoError(t, err)
		require.Len(t, st, latest(t, migrations.SQLite))
		for i, s := range st {
			require.Equal(t, goose.StateApplied, s.State)
			require.EqualValues(t, i+1, s.Source.Version)
		}
	})

	t.Run("Schema", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		require.NoError(t, migrations.Up(ctx, migrations.SQLite, b.db, migrations.Options{}))

		_, err := b.db.Exec(`INSERT INTO sqllock_locks (key, token, held, deadline, owner) VALUES ('k', 1, 1, 1700000000000, 'me')`)
		require.NoError(t, err)
		for name, stmt := range map[string]string{
			"ZeroToken":  `INSERT INTO sqllock_locks VALUES ('a', 0, 1, 1, 'o')`,
			"HeldTwo":    `INSERT INTO sqllock_locks VALUES ('b', 1, 2, 1, 'o')`,
			"StrictType": `INSERT INTO sqllock_locks VALUES ('c', 1, 1, 'soon', 'o')`,
			"NullOwner":  `INSERT INTO sqllock_locks VALUES ('d', 1, 1, 1, NULL)`,
			"DupKey":     `INSERT INTO sqllock_locks VALUES ('k', 2, 1, 1, 'o')`,
		} {
			_, err := b.db.Exec(stmt)
			require.Error(t, err, name)
		}
	})

	// Rows are the token history: deleting by hand is refused
	// (docs/pitfalls.md#19), so a key cannot start over at token 1 behind a stale holder.
	t.Run("RowsCannotBeDeleted", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		require.NoError(t, migrations.Up(ctx, migrations.SQLite, b.db, migrations.Options{}))
		_, err := b.db.Exec(`INSERT INTO sqllock_locks (key, token, held, deadline, owner) VALUES ('k', 7, 0, 1, 'me')`)
		require.NoError(t, err)
		for _, stmt := range []string{`DELETE FROM sqllock_locks`, `DELETE FROM sqllock_locks WHERE key = 'k'`} {
			_, err := b.db.Exec(stmt)
			require.ErrorContains(t, err, "never deleted", stmt)
			require.ErrorContains(t, err, "sqllock release --force", stmt)
		}
		var token int64
		require.NoError(t, b.db.QueryRow(`SELECT token FROM sqllock_locks WHERE key = 'k'`).Scan(&token))
		require.EqualValues(t, 7, token)

		downAll(t, migrations.SQLite, b.db, migrations.Options{})
		var triggers int
		require.NoError(t, b.db.QueryRow(`SELECT count(*) FROM sqlite_master WHERE type = 'trigger'`).Scan(&triggers))
		require.Zero(t, triggers)
	})

	t.Run("DownDrops", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		require.NoError(t, migrations.Up(ctx, migrations.SQLite, b.db, migrations.Options{}))
		downAll(t, migrations.SQLite, b.db, migrations.Options{})
		require.False(t, tableExists(t, b.db, "sqllock_locks"))

		st, err := migrations.Status(ctx, migrations.SQLite, b.db, migrations.Options{})
		require.NoError(t, err)
		require.Equal(t, goose.StatePending, st[0].State)

		err = migrations.Down(ctx, migrations.SQLite, b.db, migrations.Options{})
		require.ErrorIs(t, err, goose.ErrNoNextVersion)
	})

	t.Run("CustomTable", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		o := migrations.Options{Table: "Team_Locks"}
		require.Equal(t, "Team_Locks_version", o.VersionTable())

		require.NoError(t, migrations.Up(ctx, migrations.SQLite, b.db, o))
		require.NoError(t, migrations.Up(ctx, migrations.SQLite, b.db, o))
		require.True(t, tableExists(t, b.db, "Team_Locks"))
		require.True(t, tableExists(t, b.db, "Team_Locks_version"))
		require.False(t, tableExists(t, b.db, "sqllock_locks"))

		// A second lock table in the same database is independent.
		require.NoError(t, migrations.Up(ctx, migrations.SQLite, b.db, migrations.Options{}))
		downAll(t, migrations.SQLite, b.db, o)
		require.False(t, tableExists(t, b.db, "Team_Locks"))
		require.True(t, tableExists(t, b.db, "sqllock_locks"))
	})

	t.Run("HostGooseUntouched", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		host, err := goose.NewProvider(goose.DialectSQLite3, b.db, fstest.MapFS{
			"00001_app.sql": {Data: []byte("-- +goose Up\nCREATE TABLE app (id INTEGER);\n-- +goose Down\nDROP TABLE app;\n")},
		}, goose.WithDisableGlobalRegistry(true))
		require.NoError(t, err)
		_, err = host.Up(ctx)
		require.NoError(t, err)

		snapshot := func() string {
			rows, err := b.db.Query(`SELECT id, version_id, is_applied, tstamp FROM goose_db_version ORDER BY id`)
			require.NoError(t, err)
			defer rows.Close()
			var sb strings.Builder
			for rows.Next() {
				var id, version, applied int64
				var ts string
				require.NoError(t, rows.Scan(&id, &version, &applied, &ts))
				fmt.Fprintf(&sb, "%d,%d,%d,%s;", id, version, applied, ts)
			}
			require.NoError(t, rows.Err())
			return sb.String()
		}
		before := snapshot()

		require.NoError(t, migrations.Up(ctx, migrations.SQLite, b.db, migrations.Options{}))
		require.NoError(t, migrations.Down(ctx, migrations.SQLite, b.db, migrations.Options{}))
		require.NoError(t, migrations.Up(ctx, migrations.SQLite, b.db, migrations.Options{}))
		require.Equal(t, before, snapshot())
		require.True(t, tableExists(t, b.db, "app"))

		hostStatus, err := host.Status(ctx)
		require.NoError(t, err)
		require.Len(t, hostStatus, 1)
		require.Equal(t, goose.StateApplied, hostStatus[0].State)
	})

	t.Run("ConcurrentUp", func(t *testing.T) {
		t.Parallel()
		// Several processes migrating one fresh file at once, each through
		// its own *sql.DB, which connects (and switches the file to WAL)
		// inside Up. The DSN deliberately leaves out _txlock=immediate:
		// goose's transactions are then deferred, and SQLite answers a lock
		// conflict it cannot wait out without risking a deadlock with
		// SQLITE_BUSY at once, busy_timeout notwithstanding. Each round is a
		// fresh file, so every round races on creating both tables.
		const rounds, n = 10, 8
		for round := range rounds {
			path := filepath.Join(t.TempDir(), fmt.Sprintf("shared%d.db", round))
			dbs := make([]*sql.DB, n)
			for i := range dbs {
				db, err := sql.Open("sqlite", path+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)")
				require.NoError(t, err)
				t.Cleanup(func() { require.NoError(t, db.Close()) })
				dbs[i] = db
			}
			start := make(chan struct{})
			errs := make(chan error, n)
			for _, db := range dbs {
				go func() {
					<-start
					errs <- migrations.Up(ctx, migrations.SQLite, db, migrations.Options{})
				}()
			}
			close(start)
			for range n {
				require.NoError(t, <-errs, "round %d", round)
			}
			var applied int
			require.NoError(t, dbs[0].QueryRow(`SELECT count(*) FROM sqllock_locks_version WHERE version_id > 0`).Scan(&applied))
			require.Equal(t, latest(t, migrations.SQLite), applied, "round %d: each migration is recorded once", round)
			require.True(t, tableExists(t, dbs[0], "sqllock_locks"))
		}
	})
}

// holdWriteLock opens path as a fresh WAL database whose version table
// exists but whose migration is pending (Up then Down), takes SQLite's write
// lock on it and returns the function that releases the lock.
func holdWriteLock(t *testing.T, path string) (release func()) {
	t.Helper()
	ctx := context.Background()
	db, err := sql.Open("sqlite", path+"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)")
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	require.NoError(t, migrations.Up(ctx, migrations.SQLite, db, migrations.Options{}))
	downAll(t, migrations.SQLite, db, migrations.Options{})
	conn, err := db.Conn(ctx)
	require.NoError(t, err)
	_, err = conn.ExecContext(ctx, `BEGIN IMMEDIATE`)
	require.NoError(t, err)
	released := false
	release = func() {
		if released {
			return
		}
		released = true
		_, err := conn.ExecContext(ctx, `ROLLBACK`)
		require.NoError(t, err)
		require.NoError(t, conn.Close())
	}
	t.Cleanup(release)
	return release
}

// openNoWait opens path with busy_timeout(0), so a lock conflict is
// SQLITE_BUSY at once and only Up's own retries can wait it out.
func openNoWait(t *testing.T, path string) *sql.DB {
	t.Helper()
	db, err := sql.Open("sqlite", path+"?_pragma=busy_timeout(0)&_pragma=journal_mode(WAL)")
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	return db
}

func TestSQLiteUpRetries(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("WhileBusy", func(t *testing.T) {
		t.Parallel()
		path := filepath.Join(t.TempDir(), "busy.db")
		release := holdWriteLock(t, path)
		db := openNoWait(t, path)
		done := make(chan error, 1)
		go func() { done <- migrations.Up(ctx, migrations.SQLite, db, migrations.Options{}) }()
		select {
		case err := <-done:
			t.Fatalf("Up returned while another connection held the write lock: %v", err)
		case <-time.After(300 * time.Millisecond):
		}
		release()
		require.NoError(t, <-done)
		require.True(t, tableExists(t, db, "sqllock_locks"))
		var applied int
		require.NoError(t, db.QueryRow(`SELECT count(*) FROM sqllock_locks_version WHERE version_id > 0`).Scan(&applied))
		require.Equal(t, latest(t, migrations.SQLite), applied)
	})

	t.Run("StopsAtContextEnd", func(t *testing.T) {
		t.Parallel()
		path := filepath.Join(t.TempDir(), "busy.db")
		holdWriteLock(t, path)
		db := openNoWait(t, path)
		cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		defer cancel()
		start := time.Now()
		err := migrations.Up(cctx, migrations.SQLite, db, migrations.Options{})
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Less(t, time.Since(start), 10*time.Second, "bounded by ctx, not by the total budget")
	})

	t.Run("PersistentAlreadyExists", func(t *testing.T) {
		t.Parallel()
		b := setup(t)
		// A table of that name made outside the migrations: retrying cannot
		// help, so Up gives up after a few attempts.
		_, err := b.db.Exec(`CREATE TABLE sqllock_locks (x INTEGER)`)
		require.NoError(t, err)
		start := time.Now()
		err = migrations.Up(ctx, migrations.SQLite, b.db, migrations.Options{})
		require.ErrorContains(t, err, "already exists")
		require.Less(t, time.Since(start), 10*time.Second)
	})
}

func TestInvalidInputRefusedBeforeIO(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	// A closed handle: any I/O would fail with sql.ErrConnDone, not our errors.
	db, err := sql.Open("sqlite", filepath.Join(t.TempDir(), "unused.db"))
	require.NoError(t, err)
	require.NoError(t, db.Close())

	for name, tc := range map[string]struct {
		d    migrations.Dialect
		o    migrations.Options
		want error
	}{
		"TableInjection": {migrations.SQLite, migrations.Options{Table: "x; drop"}, migrations.ErrInvalidIdentifier},
		"TableQuote":     {migrations.Postgres, migrations.Options{Table: `a"b`}, migrations.ErrInvalidIdentifier},
		"SchemaDot":      {migrations.Postgres, migrations.Options{Schema: "a.b"}, migrations.ErrInvalidIdentifier},
		"TableTooLong":   {migrations.SQLite, migrations.Options{Table: strings.Repeat("t", 64)}, migrations.ErrInvalidIdentifier},
		"VersionTooLong": {migrations.Postgres, migrations.Options{Table: strings.Repeat("t", 56)}, migrations.ErrInvalidIdentifier},
		"UnknownDialect": {"mysql", migrations.Options{}, migrations.ErrUnknownDialect},
		"EmptyDialect":   {"", migrations.Options{}, migrations.ErrUnknownDialect},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			require.ErrorIs(t, migrations.Up(ctx, tc.d, db, tc.o), tc.want)
			require.ErrorIs(t, migrations.Down(ctx, tc.d, db, tc.o), tc.want)
			_, err := migrations.Status(ctx, tc.d, db, tc.o)
			require.ErrorIs(t, err, tc.want)
			_, err = migrations.FS(tc.d, tc.o)
			require.ErrorIs(t, err, tc.want)
			_, err = migrations.SQL(tc.d, tc.o, "up")
			require.ErrorIs(t, err, tc.want)
		})
	}

	t.Run("SchemaOnSQLite", func(t *testing.T) {
		t.Parallel()
		err := migrations.Up(ctx, migrations.SQLite, db, migrations.Options{Schema: "app"})
		require.ErrorContains(t, err, "PostgreSQL only")
	})

	t.Run("MaxLengthTableAccepted", func(t *testing.T) {
		t.Parallel()
		_, err := migrations.FS(migrations.Postgres, migrations.Options{Table: strings.Repeat("t", 55)})
		require.NoError(t, err)
	})
}

func TestVersionTable(t *testing.T) {
	t.Parallel()
	require.Equal(t, "sqllock_locks_version", migrations.Options{}.VersionTable())
	require.Equal(t, "myschema.sqllock_locks_version", migrations.Options{Schema: "myschema"}.VersionTable())
	require.Equal(t, "s.t_version", migrations.Options{Schema: "s", Table: "t"}.VersionTable())
}

func TestSQL(t *testing.T) {
	t.Parallel()

	t.Run("Postgres", func(t *testing.T) {
		t.Parallel()
		up, err := migrations.SQL(migrations.Postgres, migrations.Options{Schema: "app", Table: "Locks"}, "up")
		require.NoError(t, err)
		require.Contains(t, up, "-- ashlock postgres migration 00001_create_locks.sql (version 1), up\n")
		require.Contains(t, up, `CREATE SCHEMA IF NOT EXISTS "app";`)
		require.Contains(t, up, `CREATE TABLE "app"."Locks" (`)
		require.Contains(t, up, "timestamptz")
		require.NotContains(t, strings.ToUpper(up), "UNLOGGED")
		requireRendered(t, up)

		down, err := migrations.SQL(migrations.Postgres, migrations.Options{Schema: "app", Table: "Locks"}, "down")
		require.NoError(t, err)
		require.Contains(t, down, "(version 1), down\n")
		require.Contains(t, down, `DROP TABLE "app"."Locks";`)
		require.Contains(t, down, "DISCARDS THE TOKEN HISTORY")
		require.NotContains(t, down, "CREATE")
		requireRendered(t, down)

		plain, err := migrations.SQL(migrations.Postgres, migrations.Options{}, "up")
		require.NoError(t, err)
		require.NotContains(t, plain, "CREATE SCHEMA")
		require.Contains(t, plain, `CREATE TABLE "sqllock_locks" (`)
	})

	t.Run("SQLite", func(t *testing.T) {
		t.Parallel()
		up, err := migrations.SQL(migrations.SQLite, migrations.Options{}, "up")
		require.NoError(t, err)
		require.Contains(t, up, "-- ashlock sqlite migration 00001_create_locks.sql (version 1), up\n")
		require.Contains(t, up, `CREATE TABLE "sqllock_locks" (`)
		require.Contains(t, up, ") STRICT;")
		requireRendered(t, up)

		down, err := migrations.SQL(migrations.SQLite, migrations.Options{}, "down")
		require.NoError(t, err)
		require.Contains(t, down, `DROP TABLE "sqllock_locks";`)
		requireRendered(t, down)
	})

	t.Run("BadDirection", func(t *testing.T) {
		t.Parallel()
		_, err := migrations.SQL(migrations.SQLite, migrations.Options{}, "sideways")
		require.Error(t, err)
	})
}

// requireRendered checks that no template or goose markers leak into SQL output.
func requireRendered(t *testing.T, s string) {
	t.Helper()
	require.NotContains(t, s, "{{")
	require.NotContains(t, s, "}}")
	require.NotContains(t, s, "+goose")
	require.NotContains(t, s, "<no value>")
}

// TestPostgres runs against the PostgreSQL harness (internal/pgtest): it
// skips without a server, and fails instead when SQLLOCK_REQUIRE_POSTGRES=1,
// as in CI. Each subtest works in its own fresh schema, dropped afterwards.
func TestPostgres(t *testing.T) {
	t.Parallel()
	url := pgtest.New(t).AdminURL
	ctx := context.Background()

	open := func(t *testing.T, searchPath string) *sql.DB {
		t.Helper()
		u := url
		if searchPath != "" {
			sep := "?"
			if strings.Contains(u, "?") {
				sep = "&"
			}
			u += sep + "search_path=" + searchPath
		}
		db, err := sql.Open("pgx", u)
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, db.Close()) })
		return db
	}
	// newSchema returns a fresh schema name (not created) and drops it after the test.
	newSchema := func(t *testing.T, prefix string) string {
		t.Helper()
		name := prefix + strings.ToLower(rand.Text())
		admin := open(t, "")
		t.Cleanup(func() {
			_, err := admin.Exec(`DROP SCHEMA IF EXISTS ` + pgx.Identifier{name}.Sanitize() + ` CASCADE`)
			require.NoError(t, err)
		})
		return name
	}
	relExists := func(t *testing.T, db *sql.DB, schema, table string) bool {
		t.Helper()
		var ok bool
		require.NoError(t, db.QueryRow(`SELECT EXISTS (SELECT 1 FROM pg_tables WHERE schemaname = $1 AND tablename = $2)`,
			schema, table).Scan(&ok))
		return ok
	}

	t.Run("SchemaUpTwiceStatusDown", func(t *testing.T) {
		t.Parallel()
		schema := newSchema(t, "t_")
		db := open(t, "")
		o := migrations.Options{Schema: schema}
		require.Equal(t, schema+".sqllock_locks_version", o.VersionTable())

		require.NoError(t, migrations.Up(ctx, migrations.Postgres, db, o))
		require.NoError(t, migrations.Up(ctx, migrations.Postgres, db, o))
		require.True(t, relExists(t, db, schema, "sqllock_locks"))
		require.True(t, relExists(t, db, schema, "sqllock_locks_version"))
		require.False(t, relExists(t, db, schema, goose.DefaultTablename))

		var persistence string
		require.NoError(t, db.QueryRow(`SELECT relpersistence FROM pg_class WHERE oid = $1::regclass`,
			schema+".sqllock_locks").Scan(&persistence))
		require.Equal(t, "p", persistence, "lock table must be LOGGED")
		_, err := db.Exec(`INSERT INTO ` + schema + `.sqllock_locks VALUES ('k', 0, true, now(), 'o')`)
		require.Error(t, err, "token must be positive")

		st, err := migrations.Status(ctx, migrations.Postgres, db, o)
		require.NoError(t, err)
		require.Len(t, st, latest(t, migrations.Postgres))
		for _, s := range st {
			require.Equal(t, goose.StateApplied, s.State)
		}

		downAll(t, migrations.Postgres, db, o)
		require.False(t, relExists(t, db, schema, "sqllock_locks"))
		require.True(t, relExists(t, db, schema, "sqllock_locks_version"))
	})

	t.Run("MixedCaseIdentifiers", func(t *testing.T) {
		t.Parallel()
		schema := newSchema(t, "T_")
		db := open(t, "")
		o := migrations.Options{Schema: schema, Table: "Locks"}
		require.NoError(t, migrations.Up(ctx, migrations.Postgres, db, o))
		require.NoError(t, migrations.Up(ctx, migrations.Postgres, db, o))
		require.True(t, relExists(t, db, schema, "Locks"))
		require.True(t, relExists(t, db, schema, "Locks_version"))
	})

	t.Run("SearchPath", func(t *testing.T) {
		t.Parallel()
		schema := newSchema(t, "t_")
		_, err := open(t, "").Exec(`CREATE SCHEMA ` + schema)
		require.NoError(t, err)
		db := open(t, schema)
		require.NoError(t, migrations.Up(ctx, migrations.Postgres, db, migrations.Options{}))
		require.NoError(t, migrations.Up(ctx, migrations.Postgres, db, migrations.Options{}))
		require.True(t, relExists(t, db, schema, "sqllock_locks"))
		require.True(t, relExists(t, db, schema, "sqllock_locks_version"))
	})

	// ConcurrentUp is the test of the session advisory lock that serializes
	// migrations: while another session holds it, every Up must wait (not
	// one may create a table), and once it is released each Up succeeds and
	// the migration is applied once. Without the lock the Up calls return
	// while it is held, and the test fails on every run.
	t.Run("ConcurrentUp", func(t *testing.T) {
		t.Parallel()
		schema := newSchema(t, "t_")
		o := migrations.Options{Schema: schema}
		const n = 4
		dbs := make([]*sql.DB, n)
		// application_name tells these sessions apart from the other
		// subtests' in pg_stat_activity.
		sep := "?"
		if strings.Contains(url, "?") {
			sep = "&"
		}
		for i := range dbs {
			db, err := sql.Open("pgx", url+sep+"application_name="+schema)
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, db.Close()) })
			dbs[i] = db
		}
		admin := open(t, "")
		// The holder takes the lock the way another host's migration would.
		holder, err := admin.Conn(ctx)
		require.NoError(t, err)
		defer holder.Close()
		_, err = holder.ExecContext(ctx, `SELECT pg_advisory_lock($1)`, migrations.LockID(o))
		require.NoError(t, err)
		unlocked := false
		unlock := func() {
			if !unlocked {
				unlocked = true
				_, err := holder.ExecContext(ctx, `SELECT pg_advisory_unlock($1)`, migrations.LockID(o))
				require.NoError(t, err)
			}
		}
		defer unlock()

		errs := make(chan error, n)
		for _, db := range dbs {
			go func() { errs <- migrations.Up(ctx, migrations.Postgres, db, o) }()
		}
		// Wait until each Up has asked for the lock (and been refused),
		// failing at once if any returns meanwhile.
		waiting := func() int {
			var k int
			require.NoError(t, admin.QueryRowContext(ctx, `SELECT count(*) FROM pg_stat_activity
				WHERE application_name = $1 AND query LIKE '%pg_try_advisory_lock%'`, schema).Scan(&k))
			return k
		}
		deadline := time.Now().Add(30 * time.Second)
		for waiting() < n {
			select {
			case err := <-errs:
				t.Fatalf("Up returned while another session held the migration lock: %v", err)
			case <-time.After(20 * time.Millisecond):
			}
			require.True(t, time.Now().Before(deadline), "the Up calls never asked for the migration lock")
		}
		select {
		case err := <-errs:
			t.Fatalf("Up returned while another session held the migration lock: %v", err)
		default:
		}
		require.False(t, relExists(t, admin, schema, "sqllock_locks"), "a table was created under another session's lock")

		unlock()
		for range n {
			require.NoError(t, <-errs)
		}
		var applied int
		require.NoError(t, holder.QueryRowContext(ctx, `SELECT count(*) FROM `+schema+`.sqllock_locks_version WHERE version_id > 0`).Scan(&applied))
		require.Equal(t, latest(t, migrations.Postgres), applied, "each migration applied once")
	})
}

func TestLockIDDistinctFromGoose(t *testing.T) {
	t.Parallel()
	require.NotEqual(t, lock.DefaultLockID, migrations.LockID(migrations.Options{}))
	require.NotEqual(t, migrations.LockID(migrations.Options{}), migrations.LockID(migrations.Options{Table: "other"}))
}
