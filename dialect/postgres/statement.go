package postgres

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/ashlock/ashlock/sqllock"

	"github.com/ashlock/ashlock/internal/wait"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// conflictAttempts bounds how many times a statement is sent while it keeps
// failing with a serialization failure or a deadlock (see queryRow).
const conflictAttempts = 10

// queryRow sends sql with args, one statement in one round trip, and scans
// its one row into dest.
//
// The statement runs on the application's pool, in an implicit transaction
// of its own; queryRow also:
//
//   - checks, with the first statement, whether a pooler in transaction
//     mode stands between the pool and the server while the pool's
//     settings need sessions (pooler.go);
//   - takes the connection from the pool itself, and closes it instead of
//     handing it back when the server answered with an error that condemns
//     the session (see unusable): after a failover the pool's connections
//     may reach a server that is now read-only, while a new connection
//     reaches the new primary (river#1225);
//   - reports a statement that succeeded as unsettled when its commit may
//     not have waited for the synchronous standbys (see syncwait.go);
//   - sends the statement again when it failed with a serialization
//     failure or a deadlock (see isConflict), up to conflictAttempts times
//     with a short jittered backoff, while ctx lasts: such a statement was
//     rolled back with its implicit transaction, so sending it again is as
//     safe as sending it the first time. Sessions at REPEATABLE READ or
//     SERIALIZABLE (default_transaction_isolation in the DSN, the role or
//     the database) meet them under contention (pglock#29, #39), and a lock
//     must not make its callers handle them. (The statement cannot lower
//     its own isolation level: SET TRANSACTION must precede the
//     transaction's first query, so that would take BEGIN ISOLATION LEVEL
//     READ COMMITTED and COMMIT around it, three statements instead of one
//     on every call, to spare a resend on the rare conflict.)
func (b *Backend) queryRow(ctx context.Context, sql string, args []any, dest ...any) error {
	return b.queryRowVia(ctx, sendOpts{pooler: true}, sql, args, dest...)
}

// queryRowVia is queryRow run as o says.
func (b *Backend) queryRowVia(ctx context.Context, o sendOpts, sql string, args []any, dest ...any) error {
	if b.db != nil {
		// A copy: dest itself stays on the pgx path's stack (the DB path
		// may hand its copy to a goroutine, see bounded).
		return b.queryRowDB(ctx, o, sql, args, append([]any(nil), dest...))
	}
	return b.send(ctx, o, func(c *pgx.Conn) error {
		return c.QueryRow(ctx, sql, args...).Scan(dest...)
	})
}

// queryRows is queryRow for a statement that returns many rows: it scans
// each row into dest and calls each. On a resend (see queryRow) the rows
// come again from the start. A statement that succeeded is reported as
// unsettled as in queryRow (its rows have been handed to each already).
func (b *Backend) queryRows(ctx context.Context, sql string, args []any, dest []any, each func() error) error {
	return b.queryRowsVia(ctx, sendOpts{}, sql, args, dest, each)
}

// queryRowsVia is queryRows run as o says.
func (b *Backend) queryRowsVia(ctx context.Context, o sendOpts, sql string, args []any, dest []any, each func() error) error {
	if b.db != nil {
		return b.queryRowsDB(ctx, o, sql, args, dest, each)
	}
	return b.send(ctx, o, func(c *pgx.Conn) error {
		rows, err := c.Query(ctx, sql, args...)
		if err == nil {
			_, err = pgx.ForEachRow(rows, dest, each)
		}
		return err
	})
}

// listRows runs List's statement (sql with prefix) on a connection of the
// pool, scanning each row into dest and calling each; a read-only
// statement, sent without the pooler check and reported as it failed,
// never as unsettled.
func (b *Backend) listRows(ctx context.Context, sql, prefix string, dest []any, each func() error) error {
	if b.db != nil {
		return b.listRowsDB(ctx, sql, prefix, dest, each)
	}
	rows, err := b.pool.Query(ctx, sql, prefix)
	if err != nil {
		return err
	}
	_, err = pgx.ForEachRow(rows, dest, each)
	return err
}

// sendOpts say how send runs a statement: with the pooler check (pooler),
// and whether it may go through the aside connection while the pool is
// suspect (aside: renewals and releases, see aside.go).
type sendOpts struct{ pooler, aside bool }

// send runs one statement (run) on a connection of the pool, as queryRow
// describes, or, for a renewal while the pool is suspect, on the aside
// connection.
func (b *Backend) send(ctx context.Context, o sendOpts, run func(*pgx.Conn) error) error {
	return b.retryConflicts(ctx, func() error {
		if o.aside && b.aside.active() {
			return b.aside.run(ctx, b, run)
		}
		var c *pgxpool.Conn
		var err error
		if o.pooler {
			c, _, err = b.checkedConn(ctx, "")
		} else {
			c, err = b.pool.Acquire(ctx)
		}
		if errors.Is(err, ErrPoolerSettings) {
			return err
		}
		if err != nil {
			// Nothing was sent (but perhaps a pooler check): waiting for a
			// connection (or dialing one) failed, so the outcome is known,
			// not indeterminate.
			b.aside.noteAbandoned(ctx)
			return notSentError{err}
		}
		defer c.Release()
		err = runOn(ctx, c.Conn(), run)
		if unusable(err) {
			discard(ctx, c.Conn())
		}
		if err != nil {
			b.aside.noteAbandoned(ctx)
		}
		return err
	})
}

// runOn runs one statement on conn and reports a statement that succeeded
// as unsettled when its commit may not have waited for the synchronous
// standbys (syncwait.go).
func runOn(ctx context.Context, conn *pgx.Conn, run func(*pgx.Conn) error) error {
	pc := conn.PgConn()
	clearWarning(pc)
	err := run(conn)
	if err == nil {
		err = unsettled(ctx, pc)
	}
	return err
}

// retryConflicts runs send, one statement on the pool, until it does not
// fail with a conflict (see queryRow), at most conflictAttempts times and
// while ctx lasts. Its error after the last attempt is a *conflictError.
func (b *Backend) retryConflicts(ctx context.Context, send func() error) error {
	for attempt := 1; ; attempt++ {
		err := send()
		if err == nil || !isConflict(err) {
			return err
		}
		if attempt == conflictAttempts {
			return &conflictError{attempts: attempt, err: err}
		}
		if wait.Sleep(ctx, conflictBackoff(attempt)) != nil {
			return &conflictError{attempts: attempt, err: err, ctxErr: ctx.Err()}
		}
		b.conflictRetries.Add(1)
	}
}

// conflictBackoff is the pause after the attempt-th sending of a statement
// failed with a conflict: uniform in [0, d] for d = 1ms, 2ms, 4ms, 8ms, then
// 16ms (at most 95ms over all attempts). The transaction it conflicted with
// has usually ended by the time the error arrives, so sending it again soon
// usually succeeds; the jitter parts statements that conflicted with each
// other.
func conflictBackoff(attempt int) time.Duration {
	d := time.Millisecond << min(attempt-1, 4)
	return rand.N(d + 1)
}

// discard closes conn, taken from the pool, so that the pool destroys it
// when it is released and dials a new one when it needs one. Close sends
// Terminate without waiting for an answer; it gets a second of its own
// since ctx may have ended.
func discard(ctx context.Context, conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	_ = conn.Close(ctx)
}

// notSentError marks an error that happened before the statement was sent
// (taking a connection from the pool): pgconn.SafeToRetry reports it, so
// translate says "not sent" rather than "indeterminate".
type notSentError struct{ err error }

func (e notSentError) Error() string     { return e.err.Error() }
func (e notSentError) Unwrap() error     { return e.err }
func (e notSentError) SafeToRetry() bool { return true }

// isConflict reports a statement that failed with a serialization failure
// or a deadlock: the server rolled back its transaction, and sending it
// again in a new one is safe.
func isConflict(err error) bool {
	pgErr, ok := errors.AsType[*pgconn.PgError](err)
	return ok && (pgErr.Code == "40001" || pgErr.Code == "40P01")
}

// unusable reports a server error after which the session must not be used
// again: the server is read-only (25006: a hot standby, or a primary demoted
// by a failover, while a new connection may reach the new primary), it is
// shutting down or refusing sessions (class 57P: admin_shutdown,
// crash_shutdown, cannot_connect_now, database_dropped,
// idle_session_timeout), or the error is FATAL (the server ends the
// session; pgx closes it by default, unless the application replaced
// pgconn.Config.OnPgError).
func unusable(err error) bool {
	if err == nil {
		return false
	}
	pgErr, ok := errors.AsType[*pgconn.PgError](err)
	if !ok {
		return false
	}
	severity := pgErr.SeverityUnlocalized // PostgreSQL >= 9.6
	if severity == "" {
		severity = pgErr.Severity
	}
	return pgErr.Code == "25006" || strings.HasPrefix(pgErr.Code, "57P") || severity == "FATAL" || severity == "PANIC"
}

// conflictError is the last error of a statement that kept failing with a
// serialization failure or a deadlock (isConflict), after attempts
// sendings, or that was not sent again because the context ended (ctxErr).
type conflictError struct {
	attempts int
	err      error
	ctxErr   error
}

// Error is the last error's: translatePg tells how many times it happened.
func (e *conflictError) Error() string { return e.err.Error() }

func (e *conflictError) Unwrap() []error {
	if e.ctxErr != nil {
		return []error{e.err, e.ctxErr}
	}
	return []error{e.err}
}

// conflict is the error of a statement that failed with a conflict (code
// 40001 or 40P01), sent again as retryConflicts says: not applied.
func conflict(prefix, code string, err error) error {
	what := "a serialization failure"
	if code == "40P01" {
		what = "a deadlock"
	}
	ce, resent := errors.AsType[*conflictError](err)
	switch {
	case resent && ce.ctxErr != nil:
		return fmt.Errorf("%s: %w: transaction conflict (%s, %d times), not applied before the context ended: %w",
			prefix, sqllock.ErrUnavailable, what, ce.attempts, err)
	case resent:
		return fmt.Errorf("%s: %w: transaction conflict: the statement failed with %s each of the %d times it was sent "+
			"(do sessions default to SERIALIZABLE or REPEATABLE READ isolation?), not applied: %w",
			prefix, sqllock.ErrUnavailable, what, ce.attempts, err)
	}
	return fmt.Errorf("%s: %w: transaction conflict (%s), not applied: %w", prefix, sqllock.ErrUnavailable, what, err)
}

// isConnectionError reports a broken or closed connection (not a server
// error). database/sql's driver.ErrBadConn is one: lib/pq returns it also
// for a connection that broke while it read the reply (pgx's stdlib
// driver only before sending, see driverError).
func isConnectionError(err error) bool {
	if errors.Is(err, pgconn.ErrConnClosed) || errors.Is(err, net.ErrClosed) || errors.Is(err, driver.ErrBadConn) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNREFUSED) {
		return true
	}
	_, ok := errors.AsType[net.Error](err)
	return ok
}
