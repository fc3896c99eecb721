package sqlite

import (
	"context"
	"errors"
	"fmt"
	"strings"

	msqlite "modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/ashlock/ashlock/internal/sqlitecode"
	"github.com/ashlock/ashlock/sqllock"
)

var errClosed = fmt.Errorf("sqllock/sqlite: backend closed: %w", sqllock.ErrClosed)

// ErrUnusable is matched (errors.Is) by errors about the database file
// that waiting cannot heal: it is read-only, not a SQLite database, corrupt,
// or cannot be opened (a missing directory, permissions). Unlike
// [sqllock.ErrUnavailable], such an error is not retried: Acquire returns it
// at once.
var ErrUnusable = errors.New("sqllock/sqlite: database file unusable")

// sqlitecode reads codes through this method of *modernc.org/sqlite.Error.
var _ interface{ Code() int } = (*msqlite.Error)(nil)

// code returns the primary SQLite result code of err (extended codes
// masked), or 0.
func code(err error) int {
	c, _ := sqlitecode.Primary(err)
	return c
}

// isBusy reports whether err means "the database is locked by another
// connection; nothing was applied": SQLITE_BUSY (including BUSY_SNAPSHOT,
// BUSY_RECOVERY, BUSY_TIMEOUT) or SQLITE_LOCKED.
func isBusy(err error) bool { return sqlitecode.IsBusy(err) }

// transientReadonly reports whether a SQLITE_READONLY error is one that
// another process clears by itself: WAL recovery in progress, or a shared
// memory file not yet initialised.
func transientReadonly(err error) bool {
	var c interface{ Code() int }
	if !errors.As(err, &c) {
		return false
	}
	switch c.Code() {
	case sqlite3.SQLITE_READONLY_RECOVERY, sqlite3.SQLITE_READONLY_CANTINIT:
		return true
	}
	return false
}

// translate maps a driver error to ashlock's errors, once, at the backend
// boundary. write says whether the failed operation writes.
func (b *Backend) translate(err error, write bool) error {
	if err == nil {
		return nil
	}
	var be *busyError
	if errors.As(err, &be) || errors.Is(err, sqllock.ErrClosed) ||
		errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	if strings.Contains(err.Error(), "sql: database is closed") { // database/sql does not export it
		return errClosed
	}
	c := code(err)
	switch {
	case c == sqlite3.SQLITE_ERROR && strings.Contains(err.Error(), "no such table"):
		return fmt.Errorf("%w: table %q: %w", sqllock.ErrSchemaMissing, b.table, err)
	case c == sqlite3.SQLITE_ERROR && (strings.Contains(err.Error(), "no such column") || strings.Contains(err.Error(), "has no column named")):
		// A table from before a migration this code needs (00003's value):
		// Open applies them; with New, run `sqllock migrate up`.
		return fmt.Errorf("%w: table %q lacks a column of a newer migration (run `sqllock migrate up`): %w", sqllock.ErrSchemaMissing, b.table, err)
	case c == sqlite3.SQLITE_IOERR && write:
		// A failed fsync at commit may leave a complete commit record in
		// the WAL, which recovery would apply: the outcome is unknown.
		return fmt.Errorf("%w: I/O error during a write: %w", sqllock.ErrIndeterminate, err)
	case c == sqlite3.SQLITE_READONLY && !transientReadonly(err):
		return fmt.Errorf("%w: read-only (make the file and its directory writable): %w", ErrUnusable, err)
	case c == sqlite3.SQLITE_NOTADB:
		return fmt.Errorf("%w: not a SQLite database: %w", ErrUnusable, err)
	case c == sqlite3.SQLITE_CORRUPT:
		return fmt.Errorf("%w: corrupt: %w", ErrUnusable, err)
	case c == sqlite3.SQLITE_CANTOPEN, c == sqlite3.SQLITE_PERM, c == sqlite3.SQLITE_AUTH:
		return fmt.Errorf("%w: cannot open it (check the path, its directory and their permissions): %w", ErrUnusable, err)
	case c == sqlite3.SQLITE_IOERR, c == sqlite3.SQLITE_FULL, c == sqlite3.SQLITE_READONLY,
		c == sqlite3.SQLITE_NOMEM, c == sqlite3.SQLITE_PROTOCOL,
		c == sqlite3.SQLITE_INTERRUPT:
		return fmt.Errorf("%w: %w", sqllock.ErrUnavailable, err)
	}
	return fmt.Errorf("sqllock/sqlite: %w", err)
}
