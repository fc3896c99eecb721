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
// [NewProvider]); on SQLite, a concurrent Up that loses the race reports
// success once the winner has applied everything.
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
	"path"
	"slices"
	"strings"
	"testing/fstest"
	"text/template"

	"github.com/pressly/goose/v3"
	"github.com/pressly/goose/v3/lock"

	"github.com/ashlock/ashlock/internal/sqlident"
)

//go:embed postgres/*.sql sqlite/*.sql
var embedded embed.FS

// Dialect names a supported database.
type Dialect string

// The supported dialects.
const (
	Postgres Dialect = "postgres"
	SQLite   Dialect = "sqlite"
)

// DefaultTable is the lock table's name when Options.Table is empty.
const DefaultTable = "sqllock_locks"

// versionSuffix turns the lock table's name into the version table's.
const versionSuffix = "_version"

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
	case SQLite:
		if o.Schema != "" {
			return fmt.Errorf("migrations: Options.Schema %q is PostgreSQL only; SQLite has no schemas", o.Schema)
		}
	default:
		return fmt.Errorf("%w %q (want %q or %q)", ErrUnknownDialect, d, Postgres, SQLite)
	}
	if o.Schema != "" {
		if err := sqlident.Validate(o.Schema); err != nil {
			return fmt.Errorf("migrations: schema: %w", err)
		}
	}
	if err := sqlident.Validate(o.table()); err != nil {
		return fmt.Errorf("migrations: table: %w", err)
	}
	// The derived name must be valid too: PostgreSQL would silently truncate
	// a name over 63 bytes, and the version table would not be found again.
	if err := sqlident.Validate(o.table() + versionSuffix); err != nil {
		return fmt.Errorf("migrations: table name too long for its %q suffix: %w", versionSuffix, err)
	}
	return nil
}

// quoted returns the identifiers as they appear in the rendered SQL.
func (o Options) quoted(d Dialect) (schema, table, versionTable string) {
	if d == SQLite {
		return "", sqlident.QuoteSQLite(o.table()), sqlident.QuoteSQLite(o.table() + versionSuffix)
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
	data := struct{ Schema, Table string }{schema, table}

	names, err := fs.Glob(embedded, path.Join(string(d), "*.sql"))
	if err != nil {
		return nil, err
	}
	out := fstest.MapFS{}
	for _, name := range names {
		src, err := embedded.ReadFile(name)
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
	if d == Postgres {
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
	} else {
		_, _, versionTable := o.quoted(d)
		base = append(base, goose.WithTableName(versionTable))
	}
	return goose.NewProvider(gooseDialect, db, fsys, append(base, opts...)...)
}

// Up applies all pending migrations; it is a no-op when none are pending.
func Up(ctx context.Context, d Dialect, db *sql.DB, o Options) error {
	p, err := NewProvider(d, db, o)
	if err != nil {
		return err
	}
	_, err = p.Up(ctx)
	if err != nil && d == SQLite {
		// SQLite has no session lock: two processes may both see a migration
		// pending and the second to commit fails. If everything is applied
		// now, the goal is reached.
		if pending, perr := p.HasPending(ctx); perr == nil && !pending {
			return nil
		}
	}
	if err != nil {
		return fmt.Errorf("migrations: up: %w", err)
	}
	return nil
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

// SQL returns d's migrations rendered for o as plain SQL for direction "up"
// (ascending versions) or "down" (descending), for teams that apply schema
// with their own tool. Each file's section starts with a comment naming its
// goose file and version. The goose version table is not part of the output.
func SQL(d Dialect, o Options, direction string) (string, error) {
	if direction != "up" && direction != "down" {
		return "", fmt.Errorf("migrations: direction %q: want \"up\" or \"down\"", direction)
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
	if direction == "down" {
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
		if direction == "down" {
			section = down
		}
		fmt.Fprintf(&b, "-- ashlock %s migration %s (version %d), %s\n", d, name, version, direction)
		b.WriteString(strings.TrimSpace(section))
		b.WriteString("\n\n")
	}
	return b.String(), nil
}
