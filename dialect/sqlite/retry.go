package sqlite

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"time"

	msqlite "modernc.org/sqlite"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/ashlock/ashlock/internal/sqlitecode"
	"github.com/ashlock/ashlock/internal/wait"
	"github.com/ashlock/ashlock/sqllock"
)

var (
	errClosed = fmt.Errorf("sqlite: backend closed: %w", sqllock.ErrClosed)

	// errRetry asks retry to run an attempt again at once: the row moved
	// between two statements of one operation.
	errRetry = errors.New("sqlite: row changed between statements")
)

// busyError is the error after the retry budget or the caller's context
// ran out while the database stayed busy. It matches
// [sqllock.ErrUnavailable] and, when the context ended, the context's error.
type busyError struct {
	attempts int
	waited   time.Duration
	last     error // the driver's last error
	ctxErr   error
}

func (e *busyError) Error() string {
	s := fmt.Sprintf("sqlite: database busy: %d attempts in %v, not applied", e.attempts, e.waited.Round(time.Millisecond))
	if e.ctxErr != nil {
		s += " (" + e.ctxErr.Error() + ")"
	}
	return s + ": " + e.last.Error()
}

func (e *busyError) Is(target error) bool { return target == sqllock.ErrUnavailable }

func (e *busyError) Unwrap() error { return e.ctxErr }

// write runs op, one attempt of an operation that writes, holding the
// Backend's write slot, retrying while the database is busy.
func (b *Backend) write(ctx context.Context, op func(context.Context) error) error {
	if b.closed.Load() {
		return errClosed
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	select {
	case b.writeSlot <- struct{}{}:
	case <-ctx.Done():
		return ctx.Err()
	}
	defer func() { <-b.writeSlot }()
	return b.retry(ctx, b.retryTimeout, op)
}

// read runs op, a read-only attempt, retrying while the database is busy.
func (b *Backend) read(ctx context.Context, op func(context.Context) error) error {
	if b.closed.Load() {
		return errClosed
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	return b.retry(ctx, b.retryTimeout, op)
}

// maxRowChanges bounds the errRetry loop; the row cannot keep moving back.
const maxRowChanges = 10

// retry runs op until it returns something other than a busy error, for
// at most budget, sleeping with full jitter in between. op gets ctx: its
// statements shield themselves from it once they run (see shield); ctx is
// also checked between attempts.
func (b *Backend) retry(ctx context.Context, budget time.Duration, op func(context.Context) error) error {
	start := time.Now()
	changes := 0
	for attempt := 1; ; attempt++ {
		err := op(ctx)
		if errors.Is(err, errRetry) && changes < maxRowChanges {
			changes++
			continue
		}
		if err == nil || !isBusy(err) {
			return err
		}
		b.busyRetries.Add(1)
		waited := time.Since(start)
		if waited >= budget {
			return &busyError{attempts: attempt, waited: waited, last: err}
		}
		// Full jitter over an exponential cap: 1, 2, 4 ... 32 ms.
		limit := time.Millisecond << min(attempt-1, 5)
		if wait.Sleep(ctx, rand.N(limit)+100*time.Microsecond) != nil {
			return &busyError{attempts: attempt, waited: time.Since(start), last: err, ctxErr: ctx.Err()}
		}
	}
}

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

// ErrUnusable is matched (errors.Is) by errors about the database file
// that waiting cannot heal: it is read-only, not a SQLite database, corrupt,
// or cannot be opened (a missing directory, permissions). Unlike
// [sqllock.ErrUnavailable], such an error is not retried: Acquire returns it
// at once.
var ErrUnusable = errors.New("sqlite: database file unusable")

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
		return fmt.Errorf("%w: table %q: %v", sqllock.ErrSchemaMissing, b.table, err)
	case c == sqlite3.SQLITE_IOERR && write:
		// A failed fsync at commit may leave a complete commit record in
		// the WAL, which recovery would apply: the outcome is unknown.
		return fmt.Errorf("%w: I/O error during a write: %v", sqllock.ErrIndeterminate, err)
	case c == sqlite3.SQLITE_READONLY && !transientReadonly(err):
		return fmt.Errorf("%w: read-only (make the file and its directory writable): %v", ErrUnusable, err)
	case c == sqlite3.SQLITE_NOTADB:
		return fmt.Errorf("%w: not a SQLite database: %v", ErrUnusable, err)
	case c == sqlite3.SQLITE_CORRUPT:
		return fmt.Errorf("%w: corrupt: %v", ErrUnusable, err)
	case c == sqlite3.SQLITE_CANTOPEN, c == sqlite3.SQLITE_PERM, c == sqlite3.SQLITE_AUTH:
		return fmt.Errorf("%w: cannot open it (check the path, its directory and their permissions): %v", ErrUnusable, err)
	case c == sqlite3.SQLITE_IOERR, c == sqlite3.SQLITE_FULL, c == sqlite3.SQLITE_READONLY,
		c == sqlite3.SQLITE_NOMEM, c == sqlite3.SQLITE_PROTOCOL,
		c == sqlite3.SQLITE_INTERRUPT:
		return fmt.Errorf("%w: %v", sqllock.ErrUnavailable, err)
	}
	return fmt.Errorf("sqlite: %w", err)
}

// shield returns the context and arguments to run one statement with, so
// that ctx bounds the wait for a connection (an application's busy pool)
// but never interrupts the statement once it runs: an interrupted write's
// outcome would be unknown, and a statement lasts at most the busy timeout
// plus one commit. database/sql converts the arguments with the connection
// in hand, right before it hands the statement to the driver; the first
// argument's conversion closes the gate. If ctx ended before that, the
// statement is not sent and the caller gets ctx's error. Call release when
// the statement's rows are closed.
func shield(ctx context.Context, args []any) (sctx context.Context, gated []any, release func()) {
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, cancel)
	g := &gate{ctx: ctx, stop: stop}
	gated = append([]any{gatedArg{v: args[0], g: g}}, args[1:]...)
	return sctx, gated, func() { stop(); cancel() }
}

// gate is shut by the first conversion of its statement's arguments.
type gate struct {
	ctx  context.Context
	stop func() bool
	once sync.Once
	shut bool // the caller's context can no longer cancel the statement
}

// gatedArg is a statement argument whose conversion shuts its gate.
type gatedArg struct {
	v any
	g *gate
}

// Value implements [driver.Valuer]. database/sql may convert the arguments
// more than once (a retry on a bad connection): the first call decides.
func (a gatedArg) Value() (driver.Value, error) {
	a.g.once.Do(func() { a.g.shut = a.g.stop() })
	if !a.g.shut {
		return nil, &notSentError{cause: context.Cause(a.g.ctx)}
	}
	return driver.DefaultParameterConverter.ConvertValue(a.v)
}

// notSentError: the caller's context ended before a statement was sent
// (while it waited for a connection). Nothing was applied; it matches
// [sqllock.ErrUnavailable] and the context's error, as a context that ends
// while the database is busy does.
type notSentError struct{ cause error }

func (e *notSentError) Error() string {
	return "sqlite: not sent, not applied: " + e.cause.Error()
}

func (e *notSentError) Is(target error) bool { return target == sqllock.ErrUnavailable }

func (e *notSentError) Unwrap() error { return e.cause }
