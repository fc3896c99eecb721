package cli

import (
	"context"
	"database/sql"
	"errors"
	"flag"
	"fmt"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/pressly/goose/v3"

	"github.com/ashlock/ashlock/migrations"
)

const migrateUsage = `
Usage: sqllock migrate up|down|status|sql [flags]

Manages the lock table (default sqllock_locks, see --table and --schema).
The applied versions are recorded in the library's own table
(<table>_version), never in your application's goose_db_version.

  up      create or upgrade the lock table (PostgreSQL and MariaDB need this once;
          a SQLite file is migrated on first use anyway)
  status  list the migrations and whether each is applied
  sql     print the SQL, for teams that apply schema with their own tool
          ("sql down" prints the rollback); it needs no database: the
          dialect comes from --dialect, else from the database URL
  down    roll back the latest migration. Rolling back the first one DROPS
          the lock table and with it the token history: fencing tokens
          restart at 1, so a resource that remembers a higher token refuses
          every new holder, and old and new tokens can collide. Only for
          uninstalling; needs --force.

Examples:
  sqllock migrate up --database-url postgres://app@db/app
  sqllock migrate up --database-url mariadb://app:secret@db/app
  sqllock migrate sql --dialect postgres --schema locks > locks.sql
`

// migrateFlags are migrate's flags.
type migrateFlags struct {
	db      dbFlags
	force   bool
	dialect string
}

func (f *migrateFlags) register(fs *flag.FlagSet) {
	fs.BoolVar(&f.force, "force", false, "allow down, which drops the token history")
	fs.StringVar(&f.dialect, "dialect", "", "for sql: postgres, sqlite or mariadb (default: from the database URL)")
	f.db.register(fs)
}

func cmdMigrate(ctx context.Context, e *env, args []string) error {
	var f migrateFlags
	fs := e.flagSet("migrate", migrateUsage)
	f.register(fs)
	// Accept flags before, between and after the words: migrate up
	// --table x, migrate sql down --dialect postgres.
	var words []string
	for rest := args; ; {
		if err := e.parse(fs, rest); err != nil {
			return err
		}
		rest = fs.Args()
		if len(rest) == 0 {
			break
		}
		words, rest = append(words, rest[0]), rest[1:]
	}
	if len(words) == 0 {
		return fail(ExitUsage, "missing action: up, down, status or sql (see sqllock migrate --help)")
	}
	action, rest, db := words[0], words[1:], f.db
	opts := migrations.Options{Schema: db.schema, Table: db.table}
	if action == "sql" {
		return e.migrateSQL(db, f.dialect, opts, rest)
	}
	if len(rest) > 0 {
		return fail(ExitUsage, "unexpected argument %q (see sqllock migrate --help)", rest[0])
	}
	switch action {
	case "up", "status":
	case "down":
		if !f.force {
			return fail(ExitUsage, "refusing to migrate down without --force: rolling back the first migration drops the lock table and discards the token history (fencing tokens restart at 1); add --force to uninstall")
		}
	default:
		return fail(ExitUsage, "unknown action %q: want up, down, status or sql", action)
	}
	res, err := e.database(db)
	if err != nil {
		return err
	}
	if res.ext != nil {
		return e.migrateDialect(res, action)
	}
	sqlDB, closeDB, err := e.openSQL(ctx, res, db.schema)
	if err != nil {
		return err
	}
	defer closeDB()
	m := migration{e: e, db: res, sqlDB: sqlDB, opts: opts}
	switch action {
	case "up":
		return m.up(ctx)
	case "down":
		return m.down(ctx)
	}
	return m.status(ctx)
}

// migrateSQL is "migrate sql [up|down]": it prints the SQL, and needs no
// database.
func (e *env) migrateSQL(db dbFlags, dialect string, opts migrations.Options, rest []string) error {
	direction := "up"
	if len(rest) > 0 {
		direction, rest = rest[0], rest[1:]
	}
	if len(rest) > 0 {
		return fail(ExitUsage, "unexpected argument %q (see sqllock migrate --help)", rest[0])
	}
	d := migrations.Dialect(dialect)
	if dialect == "" {
		res, err := e.database(db)
		if err != nil {
			return err
		}
		if res.ext != nil {
			return fail(ExitUsage, "%s has no SQL schema: there is no SQL to print", res.ext.Name)
		}
		d = res.dialect
	}
	if d != migrations.Postgres && d != migrations.SQLite && d != migrations.MariaDB {
		return fail(ExitUsage, "--dialect %q: want postgres, sqlite or mariadb", dialect)
	}
	out, err := migrations.SQL(d, opts, migrations.Direction(direction))
	if err != nil {
		return fail(ExitUsage, "%v", err)
	}
	_, err = fmt.Fprint(e.stdout, out)
	return err
}

// migrateDialect is migrate up, down or status on a Dialect's service,
// which keeps no schema: its keys need nothing created first. It does no
// I/O.
func (e *env) migrateDialect(d *database, action string) error {
	switch action {
	case "down":
		return fail(ExitUsage, "%s has no lock table to drop; nothing was deleted (its keys stay under their prefix, with their token history)", d.ext.Name)
	case "status":
		fmt.Fprintf(e.stdout, "%s needs no migration: %s\n", d.ext.Name, d.display)
		return nil
	}
	fmt.Fprintf(e.stdout, "%s needs no migration: nothing to apply in %s\n", d.ext.Name, d.display)
	return nil
}

// migration is an open database that migrate up, down or status works on.
type migration struct {
	e     *env
	db    *database
	sqlDB *sql.DB
	opts  migrations.Options
}

func (m migration) up(ctx context.Context) error {
	// What is pending now is what Up applies (another process may
	// apply it first; then this report claims it all the same).
	var pending []string
	if st, err := migrations.Status(ctx, m.db.dialect, m.sqlDB, m.opts); err == nil {
		for _, s := range st {
			if s.State == goose.StatePending {
				pending = append(pending, fmt.Sprintf("version %d (%s)", s.Source.Version, filepath.Base(s.Source.Path)))
			}
		}
	}
	if err := migrations.Up(ctx, m.db.dialect, m.sqlDB, m.opts); err != nil {
		return migrateError(err)
	}
	out, table := m.e.stdout, tableName(m.opts)
	switch len(pending) {
	case 0:
		fmt.Fprintf(out, "lock table %s is up to date in %s; nothing to apply\n", table, m.db.display)
	case 1:
		fmt.Fprintf(out, "applied 1 migration to lock table %s in %s: %s\n", table, m.db.display, pending[0])
	default:
		fmt.Fprintf(out, "applied %d migrations to lock table %s in %s: %s\n", len(pending), table, m.db.display, strings.Join(pending, ", "))
	}
	return nil
}

func (m migration) down(ctx context.Context) error {
	if err := migrations.Down(ctx, m.db.dialect, m.sqlDB, m.opts); err != nil {
		if errors.Is(err, goose.ErrNoNextVersion) {
			return fail(ExitFailure, "nothing to roll back: no migration is applied in %s", m.db.display)
		}
		return migrateError(err)
	}
	fmt.Fprintf(m.e.stdout, "rolled back the latest migration of %s in %s\n", tableName(m.opts), m.db.display)
	return nil
}

func (m migration) status(ctx context.Context) error {
	st, err := migrations.Status(ctx, m.db.dialect, m.sqlDB, m.opts)
	if err != nil {
		return migrateError(err)
	}
	tw := tabwriter.NewWriter(m.e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "VERSION\tSTATE\tAPPLIED AT\tFILE\n")
	for _, s := range st {
		at := "-"
		if !s.AppliedAt.IsZero() {
			at = s.AppliedAt.UTC().Format(time.RFC3339)
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%s\n", s.Source.Version, s.State, at, s.Source.Path)
	}
	return tw.Flush()
}

func tableName(o migrations.Options) string {
	t := o.Table
	if t == "" {
		t = migrations.DefaultTable
	}
	if o.Schema != "" {
		return o.Schema + "." + t
	}
	return t
}

func migrateError(err error) error {
	if errors.Is(err, migrations.ErrInvalidIdentifier) {
		return fail(ExitUsage, "%v", err)
	}
	return err
}
