// Package sqlitecode reads SQLite result codes from driver errors without
// linking a SQLite driver, for the packages that classify them (the SQLite
// backend and the migrations, which also serve PostgreSQL-only builds).
package sqlitecode

import "errors"

// Primary result codes used by ashlock (sqlite3.h).
const (
	Error  = 1 // SQLITE_ERROR
	Busy   = 5 // SQLITE_BUSY
	Locked = 6 // SQLITE_LOCKED
)

// Primary returns the primary SQLite result code carried by err, and
// whether err carries one: *modernc.org/sqlite.Error has a Code method.
// modernc turns on extended result codes, so the code may carry an
// extension in its high bits (SQLITE_BUSY_SNAPSHOT = 517 = 5 | 2<<8),
// masked off here.
func Primary(err error) (int, bool) {
	var c interface{ Code() int }
	if errors.As(err, &c) {
		return c.Code() & 0xff, true
	}
	return 0, false
}

// IsBusy reports whether err carries SQLITE_BUSY or SQLITE_LOCKED (any
// extended form): another connection holds a lock, and the failed
// statement changed nothing.
func IsBusy(err error) bool {
	c, _ := Primary(err)
	return c == Busy || c == Locked
}
