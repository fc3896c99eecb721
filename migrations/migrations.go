// Package migrations holds ashlock's SQL schema as goose v3 migrations, one
// directory per dialect, and a small API to apply, roll back and inspect them,
// or to print the SQL for teams that manage schema with their own tool.
//
// The lock table's name (DefaultTable unless configured) and, on PostgreSQL,
// its schema are configurable, so the migration files are text/templates
// rendered at run time with validated, quoted identifiers. Applied versions
// are recorded in the library's own version table, [Options.VersionTable]
// ("sqllock_locks_version" by default), never in the host application's
// goose_db_version, so ashlock's migrations and the application's never
// collide. Nothing here uses goose's package-level globals.
//
// All functions are safe for concurrent use. On PostgreSQL, Up and Down from
// several processes at once are serialized by a session advisory lock (see
// [NewProvider]); on SQLite, a concurrent Up that loses the race retries
// and reports success once the winner has applied everything (see [Up]).
package migrations

import (
	"bytes"
	"cmp"
	"context"
	"database/sql"
	"embed"
	"errors"
	"fmt"
	"hash/crc64"
	"io/fs"
	"math/rand/v2"
	"path"
	"slices"
	"strings"
	"testing/fstest"
	"text/template"
	"time"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"

	"github.com/ashlock/ashlock/internal/sqlident"
	"github.com/ashlock/ashlock/internal/sqlitecode"
	"github.com/ashlock/ashlock/internal/wait"
)

//go:embed postgres/*.sql sqlite/*.sql mariadb/*.sql
var embedded embed.FS

// readEmbedded reads a migration's template (see migrations_mutants.go).
var readEmbedded = embedded.ReadFile

// Dialect names a supported database.
type Dialect string

// The supported dialects.
const (
	Postgres Dialect = "postgres"
	SQLite   Dialect = "sqlite"
	// MariaDB is MariaDB 10.6 or later (this package registers no driver:
	// dialect/mariadb uses go-sql-driver/mysql). MySQL is not supported.
	MariaDB Dialect = "mariadb"
)

// DefaultTable is the lock table's name when Options.Table is empty.
const DefaultTable = "sqllock_locks"

// versionSuffix turns the lock table's name into the version table's.
const versionSuffix = sqlident.VersionSuffix

var (
	// ErrInvalidIdentifier is matched (errors.Is) by the error returned for an
	// unacceptable Options.Table or Options.Schema. It is the same value as
	// internal/sqlident's, so the sentinel is the same everywhere in ashlock.
	ErrInvalidIdentifier = sqlident.ErrInvalidIdentifier

	// ErrUnknownDialect is matched (errors.Is) by the error returned for a
	// Dialect other than Postgres and SQLite.
	ErrUnknownDialect = errors.New("migrations: unknown dialect")
)

// Options names the lock table. The zero value means the defaults.
type Options struct {
	// Schema is the PostgreSQL schema holding the lock table and its version
	// table; Up creates it if needed (and Down leaves it). Empty means
	// unqualified names, resolved through search_path. Must be empty for SQLite.
	Schema string
	// Table is the lock table's name; empty means DefaultTable. The version
	// table is named after it with a "_version" suffix, so Table may be at
	// most 55 characters.
	Table string
}

func (o Options) table() string { return cmp.Or(o.Table, DefaultTable) }

// VersionTable returns the name of the table recording which of ashlock's
// migrations are applied: "<table>_version", qualified as
// "<schema>.<table>_version" when Schema is set (PostgreSQL). The name is
// returned unquoted, for display; it is only meaningful for valid Options.
func (o Options) VersionTable() string {
	if o.Schema == "" {
		return o.table() + versionSuffix
	}
	return o.Schema + "." + o.table() + versionSuffix
}

// check validates d and o before any I/O.
func (o Options) check(d Dialect) error {
	switch d {
	case Postgres:
	case SQLite, MariaDB:
		if o.Schema != "" {
			return fmt.Errorf("migrations: Options.Schema %q is PostgreSQL only; %s has no schemas (use the connection's database)", o.Schema, d)
		}
	default:
		return fmt.Errorf("%w %q (want %q, %q or %q)", ErrUnknownDialect, d, Postgres, SQLite, MariaDB)
	}
	if o.Schema != "" {
		if err := sqlident.Validate(o.Schema); err != nil {
			return fmt.Errorf("migrations: schema: %w", err)
		}
	}
	// The derived names must be valid too: PostgreSQL would silently
	// truncate a name over 63 bytes, and the version table would not be
	// found again. The other suffixes are no longer than versionSuffix. The
	// backends apply the same rule.
	if err := sqlident.ValidateTable(o.table()); err != nil {
		return fmt.Errorf("migrations: table: %w", err)
	}
	return nil
}

// keepSuffix turns the lock table's name into that of the trigger (SQLite)
// or trigger function (PostgreSQL) that refuses deleting its rows.
const keepSuffix = "_keep"

// Suffixes for the names of the triggers (SQLite) or trigger functions
// (PostgreSQL) of migration 00002: they refuse lowering a token. Neither is
// longer than versionSuffix.
const (
	forwardSuffix        = "_forward"
	forwardReplaceSuffix = "_fwd_rep"
)

// Suffixes of migration 00005 (SQLite) and 00006 (PostgreSQL), reaping:
// the table-wide token floor (a table on SQLite, a sequence on
// PostgreSQL), SQLite's trigger that raises it on a delete and
// PostgreSQL's trigger function that refuses a first row at or below it.
const (
	floorSuffix = "_floor"
	raiseSuffix = "_raise"
)

// quotedObject returns the quoted name of the lock table's trigger (SQLite)
// or trigger function (PostgreSQL) with suffix.
func (o Options) quotedObject(d Dialect, suffix string) string {
	switch d {
	case SQLite:
		return sqlident.QuoteSQLite(o.table() + suffix)
	case MariaDB:
		return sqlident.QuoteMariaDB(o.table() + suffix)
	}
	return sqlident.QuotePostgres(o.Schema, o.table()+suffix)
}

// quoted returns the identifiers as they appear in the rendered SQL.
func (o Options) quoted(d Dialect) (schema, table, versionTable string) {
	switch d {
	case SQLite:
		return "", sqlident.QuoteSQLite(o.table()), sqlident.QuoteSQLite(o.table() + versionSuffix)
	case MariaDB:
		return "", sqlident.QuoteMariaDB(o.table()), sqlident.QuoteMariaDB(o.table() + versionSuffix)
	}
	if o.Schema != "" {
		schema = sqlident.QuotePostgres("", o.Schema)
	}
	return schema, sqlident.QuotePostgres(o.Schema, o.table()), sqlident.QuotePostgres(o.Schema, o.table()+versionSuffix)
}

// FS returns d's migrations rendered for o, as goose SQL files at the root of
// an in-memory file system. It returns an error matching ErrUnknownDialect or
// ErrInvalidIdentifier for bad input.
func FS(d Dialect, o Options) (fs.FS, error) {
	if err := o.check(d); err != nil {
		return nil, err
	}
	schema, table, _ := o.quoted(d)
	data := struct{ Schema, Table, Keep, Forward, ForwardReplace, Floor, Raise string }{
		schema, table,
		o.quotedObject(d, keepSuffix), o.quotedObject(d, forwardSuffix), o.quotedObject(d, forwardReplaceSuffix),
		o.quotedObject(d, floorSuffix), o.quotedObject(d, raiseSuffix),
	}

	names, err := fs.Glob(embedded, path.Join(string(d), "*.sql"))
	if err != nil {
		return nil, err
	}
	out := fstest.MapFS{}
	for _, name := range names {
		src, err := readEmbedded(name)
		if err != nil {
			return nil, err
		}
		tmpl, err := template.New(name).Option("missingkey=error").Parse(string(src))
		if err != nil {
			return nil, fmt.Errorf("migrations: %s: %w", name, err)
		}
		var buf bytes.Buffer
		if err := tmpl.Execute(&buf, data); err != nil {
			return nil, fmt.Errorf("migrations: %s: %w", name, err)
		}
		out[path.Base(name)] = &fstest.MapFile{Data: buf.Bytes(), Mode: 0o444}
	}
	return out, nil
}

var crcTable = crc64.MakeTable(crc64.ECMA)

// lockID is the PostgreSQL advisory lock serializing migrations of this lock
// table. It is derived from the schema and table, so it differs from goose's
// lock.DefaultLockID (the host application's migrations do not wait for ours,
// nor ours for theirs) and from other ashlock tables'.
func (o Options) lockID() int64 {
	return int64(crc64.Checksum([]byte("ashlock/migrations\x00"+o.Schema+"\x00"+o.table()), crcTable))
}

// NewProvider returns a goose provider for d's migrations, rendered for o,
// on db. It always sets goose.WithDisableGlobalRegistry(true) and the version
// table [Options.VersionTable], so do not pass WithTableName or WithStore. On
// PostgreSQL it also sets goose.WithSessionLocker with an advisory lock id
// derived from o, which makes concurrent migrations from several hosts safe;
// the lock is held on one pinned connection, so db must reach PostgreSQL
// directly or through a session-mode pooler (not PgBouncer in transaction mode).
// pgx users can get a *sql.DB with stdlib.OpenDBFromPool.
//
// Do not call Close on the returned provider: goose's Provider.Close closes db,
// which belongs to the caller. The provider is safe for concurrent use.
func NewProvider(d Dialect, db *sql.DB, o Options, opts ...goose.ProviderOption) (*goose.Provider, error) {
	fsys, err := FS(d, o)
	if err != nil {
		return nil, err
	}
	if db == nil {
		return nil, errors.New("migrations: nil *sql.DB")
	}
	base := []goose.ProviderOption{goose.WithDisableGlobalRegistry(true)}
	gooseDialect := goose.DialectSQLite3
	switch d {
	case MariaDB:
		// goose's MySQL store (with a TableExists that finds the quoted
		// table), serialized across hosts by GET_LOCK on one pinned
		// connection (mariaDBLocker).
		store, err := newMariaDBStore(o)
		if err != nil {
			return nil, err
		}
		gooseDialect = goose.DialectCustom
		base = append(base, goose.WithStore(store), goose.WithSessionLocker(mariaDBLocker{name: o.lockName()}))
	case Postgres:
		// goose polls for the lock every 5s by default; poll every second
		// instead, for the same 5 minutes, so a waiting host is not idle long.
		locker, err := lock.NewPostgresSessionLocker(lock.WithLockID(o.lockID()), lock.WithLockTimeout(1, 300))
		if err != nil {
			return nil, err
		}
		store, err := newPostgresStore(o)
		if err != nil {
			return nil, err
		}
		// goose requires the custom dialect with a custom store.
		gooseDialect = goose.DialectCustom
		base = append(base, goose.WithStore(store), goose.WithSessionLocker(locker))
	default:
		_, _, versionTable := o.quoted(d)
		base = append(base, goose.WithTableName(versionTable))
	}
	return goose.NewProvider(gooseDialect, db, fsys, append(base, opts...)...)
}

// Up applies all pending migrations; it is a no-op when none are pending.
//
// On PostgreSQL, concurrent Up calls queue on the session advisory lock (see
// [NewProvider]), and an error is returned as it comes. On MariaDB they
// queue on a named lock (GET_LOCK); one that finds the version table a
// concurrent Up has just created, still without its first row, starts
// over for up to 5 s (see upMariaDB).
//
// SQLite has no such lock, so concurrent Up calls on one database (from
// several *sql.DB handles or processes) race, and Up retries the attempts
// that lost: an attempt that fails because the database is busy or locked
// (SQLITE_BUSY or SQLITE_LOCKED, extended codes included), or because a
// concurrent Up created a table or column first ("already exists",
// "duplicate column name"), is started over
// after a short, jittered, exponentially growing sleep (at most 100ms). Each
// attempt first checks for pending migrations, so Up returns nil once the
// winner has committed them all, and a migration is never applied twice:
// goose applies each migration and records it in one transaction, and a
// failed one changes nothing. Busy is worth retrying even with busy_timeout
// set, because SQLite fails at once, without calling its busy handler, in
// some conflicts: when a deferred transaction that has read needs the write
// lock another connection holds (waiting could deadlock; a DSN with
// _txlock=immediate avoids this one), or when connections opened at the same
// time switch a fresh file to WAL. The retries stop at ctx's end, after 30s
// in all, or when the same "already exists" persists over a few attempts (a
// table made outside these migrations); Up then returns the last error. Any other
// error is returned at once.
func Up(ctx context.Context, d Dialect, db *sql.DB, o Options) error {
	switch d {
	case SQLite:
		return upSQLite(ctx, db, o)
	case MariaDB:
		return upMariaDB(ctx, db, o)
	}
	p, err := NewProvider(d, db, o)
	if err != nil {
		return err
	}
	if _, err := p.Up(ctx); err != nil {
		return fmt.Errorf("migrations: up: %w", err)
	}
	return nil
}

// mariaDBUpBudget bounds upMariaDB's retries.
const mariaDBUpBudget = 5 * time.Second

// upMariaDB is Up for MariaDB: goose's Up, again while it finds the
// version table without its first row. goose checks for pending
// migrations before it takes the migration lock, and creates the version
// table then if there is none: on MariaDB, whose CREATE TABLE commits at
// once, a concurrent Up can find that table before its creator has
// written the first row, and goose then fails ("missing zero version
// migration") without applying anything. The creator writes the row
// next, so the attempt is started over on a fresh provider (goose
// creates its table at most once per provider) after a short sleep, for
// at most mariaDBUpBudget: a table left empty for longer (its creator
// died between the two statements) is an error to fix by hand.
func upMariaDB(ctx context.Context, db *sql.DB, o Options) error {
	start := time.Now()
	for attempt := 1; ; attempt++ {
		p, err := NewProvider(MariaDB, db, o)
		if err != nil {
			return err
		}
		_, err = p.Up(ctx)
		if err == nil {
			return nil
		}
		if !strings.Contains(err.Error(), "missing zero version migration") || time.Since(start) >= mariaDBUpBudget {
			return fmt.Errorf("migrations: up: %w", err)
		}
		if wait.Sleep(ctx, 10*time.Millisecond+rand.N(20*time.Millisecond)) != nil {
			return fmt.Errorf("migrations: up: %w (after %d attempts; last: %w)", ctx.Err(), attempt, err)
		}
	}
}

// Bounds of Up's retries on SQLite.
const (
	sqliteUpBudget     = 30 * time.Second       // total, from the first attempt
	sqliteUpMaxBackoff = 100 * time.Millisecond // cap of one sleep
	sqliteUpMaxExists  = 3                      // "already exists" retries
)

// upSQLite is Up for SQLite: goose's Up, retried while it loses a race with
// a concurrent Up (see Up).
func upSQLite(ctx context.Context, db *sql.DB, o Options) error {
	start := time.Now()
	exists, lastExists := 0, ""
	for attempt := 1; ; attempt++ {
		// A fresh provider for every attempt: goose creates its version
		// table at most once per provider (a sync.Once) and, when that
		// failed, would not try again but go on as if the table existed.
		p, err := NewProvider(SQLite, db, o)
		if err != nil {
			return err
		}
		_, err = p.Up(ctx)
		if err == nil {
			return nil
		}
		switch {
		case isSQLiteBusy(err):
		case isSQLiteExists(err) && (exists < sqliteUpMaxExists || err.Error() != lastExists):
			// Counted per error: each migration a loser finds applied
			// (a table, then a column, ...) is one more race lost, not
			// an "already exists" that persists.
			if err.Error() != lastExists {
				exists, lastExists = 0, err.Error()
			}
			exists++
		default:
			return fmt.Errorf("migrations: up: %w", err)
		}
		if ctx.Err() != nil {
			return fmt.Errorf("migrations: up: %w (after %d attempts; last: %w)", ctx.Err(), attempt, err)
		}
		waited := time.Since(start)
		if waited >= sqliteUpBudget {
			return fmt.Errorf("migrations: up: gave up after %d attempts in %v: %w",
				attempt, waited.Round(time.Millisecond), err)
		}
		// Full jitter, so the losers do not collide again in step, over an
		// exponential cap: 1, 2, 4 ... 64, 100 ms.
		limit := min(time.Millisecond<<min(attempt-1, 7), sqliteUpMaxBackoff)
		if wait.Sleep(ctx, rand.N(limit)+100*time.Microsecond) != nil {
			return fmt.Errorf("migrations: up: %w (after %d attempts; last: %w)", ctx.Err(), attempt, err)
		}
	}
}

// isSQLiteBusy reports whether err is SQLITE_BUSY or SQLITE_LOCKED: another
// connection holds a lock, and the failed statement changed nothing. For a
// driver whose errors carry no code, it falls back to SQLite's messages for
// these two codes.
func isSQLiteBusy(err error) bool {
	if _, ok := sqlitecode.Primary(err); ok {
		return sqlitecode.IsBusy(err)
	}
	msg := err.Error()
	return strings.Contains(msg, "database is locked") || strings.Contains(msg, "database table is locked")
}

// isSQLiteExists reports whether err is SQLite's "table ... already exists"
// (or index, trigger, view). SQLite reports it as a plain SQLITE_ERROR, so
// only the message tells it apart.
func isSQLiteExists(err error) bool {
	if c, ok := sqlitecode.Primary(err); ok && c != sqlitecode.Error {
		return false
	}
	// "duplicate column name": a concurrent Up added the column (00003) first.
	return strings.Contains(err.Error(), "already exists") || strings.Contains(err.Error(), "duplicate column name")
}

// Down rolls back the most recent applied migration (one step). When nothing
// is applied, the error matches goose.ErrNoNextVersion.
//
// Rolling back the first migration drops the lock table and with it the token
// history: fencing tokens restart. It is only for uninstalling ashlock.
func Down(ctx context.Context, d Dialect, db *sql.DB, o Options) error {
	p, err := NewProvider(d, db, o)
	if err != nil {
		return err
	}
	if _, err := p.Down(ctx); err != nil {
		return fmt.Errorf("migrations: down: %w", err)
	}
	return nil
}

// Status reports every migration, applied or pending, in ascending order.
func Status(ctx context.Context, d Dialect, db *sql.DB, o Options) ([]*goose.MigrationStatus, error) {
	p, err := NewProvider(d, db, o)
	if err != nil {
		return nil, err
	}
	st, err := p.Status(ctx)
	if err != nil {
		return nil, fmt.Errorf("migrations: status: %w", err)
	}
	return st, nil
}

// Direction selects what [SQL] renders.
type Direction string

// The directions.
const (
	DirectionUp   Direction = "up"   // apply: every migration, ascending versions
	DirectionDown Direction = "down" // roll back: every migration, descending versions
)

// ErrUnknownDirection is matched (errors.Is) by the error [SQL] returns for a
// Direction other than DirectionUp and DirectionDown.
var ErrUnknownDirection = errors.New("migrations: unknown direction")

// SQL returns d's migrations rendered for o as plain SQL for direction, for
// teams that apply schema with their own tool. Each file's section starts
// with a comment naming its goose file and version. The goose version
// table is not part of the output.
func SQL(d Dialect, o Options, direction Direction) (string, error) {
	if direction != DirectionUp && direction != DirectionDown {
		return "", fmt.Errorf("%w %q (want %q or %q)", ErrUnknownDirection, direction, DirectionUp, DirectionDown)
	}
	fsys, err := FS(d, o)
	if err != nil {
		return "", err
	}
	names, err := fs.Glob(fsys, "*.sql")
	if err != nil {
		return "", err
	}
	slices.Sort(names) // zero-padded versions sort numerically
	if direction == DirectionDown {
		slices.Reverse(names)
	}
	var b strings.Builder
	for _, name := range names {
		version, err := goose.NumericComponent(name)
		if err != nil {
			return "", err
		}
		src, err := fs.ReadFile(fsys, name)
		if err != nil {
			return "", err
		}
		_, body, ok := strings.Cut(string(src), "-- +goose Up\n")
		up, down, ok2 := strings.Cut(body, "-- +goose Down\n")
		if !ok || !ok2 {
			return "", fmt.Errorf("migrations: %s: missing goose Up/Down annotation", name)
		}
		section := up
		if direction == DirectionDown {
			section = down
		}
		// goose's statement markers mean nothing to other tools (psql and
		// sqlite3 split a $$ body or a trigger's BEGIN ... END themselves).
		var lines []string
		for line := range strings.Lines(section) {
			if !strings.HasPrefix(line, "-- +goose ") {
				lines = append(lines, line)
			}
		}
		fmt.Fprintf(&b, "-- ashlock %s migration %s (version %d), %s\n", d, name, version, direction)
		b.WriteString(strings.TrimSpace(strings.Join(lines, "")))
		b.WriteString("\n\n")
	}
	return b.String(), nil
}
