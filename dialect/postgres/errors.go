package postgres

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/ashlock/ashlock/sqllock"
)

// op names a backend operation in errors, and says whether a failure after
// the request was sent leaves its outcome unknown to the caller.
type op string

const (
	opAcquire op = "acquire"
	opRenew   op = "renew"
	opRelease op = "release"
	opList    op = "list"
	opFence   op = "fenced transaction"
	opCommit  op = "fenced transaction commit"
)

// indeterminate reports whether a failure in flight leaves the caller unable
// to tell whether o took effect, in a way that matters: a grant or a release
// may have committed. A renew keeps the token, so repeating it is safe and a
// failed renew is merely unavailable; list and the fenced transaction's
// first statement change nothing.
func (o op) indeterminate() bool {
	return o == opAcquire || o == opRelease || o == opCommit
}

// notSent wraps the error of a context that had ended before a request was
// sent: the operation was not applied.
func notSent(o op, key string, err error) error {
	return fmt.Errorf("sqllock/postgres: %s %q: not sent: %w", o, key, err)
}

// translate turns a pgx error into the sqllock error that describes it, once,
// at the backend boundary: the sentinels for the classes callers act on,
// with a message that says what happened, wrapping the original error.
func (b *Backend) translate(ctx context.Context, o op, key string, err error) error {
	prefix := fmt.Sprintf("sqllock/postgres: %s %q", o, key)
	if errors.Is(err, ErrPoolerSettings) {
		return fmt.Errorf("%s: not applied: %w", prefix, err)
	}
	if ue, ok := errors.AsType[*unsettledError](err); ok {
		// The reply said it committed; a failover may still lose it.
		what := "the server answered that it committed, but perhaps without waiting for the synchronous standbys " +
			"(PostgreSQL commits locally and only warns when that wait is cancelled), so a failover may lose it"
		if o.indeterminate() {
			return fmt.Errorf("%s: %w: %w: %s", prefix, sqllock.ErrIndeterminate, ue, what)
		}
		return fmt.Errorf("%s: %w: %w: %s", prefix, sqllock.ErrUnavailable, ue, what)
	}
	if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok {
		// The server answered: the statement failed and was rolled back
		// (a failed COMMIT too), so the outcome is known.
		return translatePg(ctx, prefix, b.table, pgErr, err)
	}
	if _, ok := errors.AsType[*pgconn.ConnectError](err); ok {
		return fmt.Errorf("%s: %w: cannot connect to the database: %w", prefix, sqllock.ErrUnavailable, err)
	}
	if o == opCommit && ctx.Err() != nil {
		// pgx#2110: a COMMIT that failed with the context may have been
		// applied; never claim otherwise.
		return fmt.Errorf("%s: %w: the context ended around the commit, which may have been applied: %w",
			prefix, sqllock.ErrIndeterminate, err)
	}
	if pgconn.SafeToRetry(err) {
		// Nothing was sent.
		if ctx.Err() != nil {
			return fmt.Errorf("%s: not sent: %w", prefix, err)
		}
		return fmt.Errorf("%s: %w: the request could not be sent: %w", prefix, sqllock.ErrUnavailable, err)
	}
	ctxEnded := ctx.Err() != nil
	broken := pgconn.Timeout(err) || isConnectionError(err)
	switch {
	case ctxEnded && o.indeterminate():
		return fmt.Errorf("%s: %w: the context ended while the statement was in flight, and it may have committed: %w",
			prefix, sqllock.ErrIndeterminate, err)
	case ctxEnded:
		return fmt.Errorf("%s: %w: the context ended while the statement was in flight: %w", prefix, sqllock.ErrUnavailable, err)
	case broken && o.indeterminate():
		return fmt.Errorf("%s: %w: %w: the connection failed after the statement was sent, and it may have committed: %w",
			prefix, sqllock.ErrIndeterminate, sqllock.ErrUnavailable, err)
	case broken:
		return fmt.Errorf("%s: %w: the connection failed: %w", prefix, sqllock.ErrUnavailable, err)
	}
	return fmt.Errorf("%s: %w", prefix, err)
}

func translatePg(ctx context.Context, prefix, table string, pgErr *pgconn.PgError, err error) error {
	code := pgErr.Code
	switch {
	case isForeignStatement(pgErr):
		return fmt.Errorf("%s: not applied: %w: the server connection lacks the statement pgx prepared, or has another client's "+
			"(the pool's connections go through a pooler in transaction mode, such as PgBouncer): set default_query_exec_mode=exec "+
			"(or cache_describe, or simple_protocol) in the connection string, and postgres.Options{DisableNotify: true}: %w",
			prefix, ErrPoolerSettings, err)
	case code == "42P01" || code == "3F000": // undefined_table, invalid_schema_name
		return fmt.Errorf("%s: %w: table %s does not exist: %w",
			prefix, sqllock.ErrSchemaMissing, table, err)
	case code == "42703": // undefined_column: the table predates a migration
		return fmt.Errorf("%s: %w: table %s lacks a column this version needs; "+
			"run `sqllock migrate up` or migrations.Up: %w", prefix, sqllock.ErrSchemaMissing, table, err)
	case code == "25006": // read_only_sql_transaction
		return fmt.Errorf("%s: %w: the database is read-only (a hot standby, or default_transaction_read_only is on); connect to the primary: %w",
			prefix, sqllock.ErrUnavailable, err)
	case code == "57P01" || code == "57P02" || code == "57P03": // admin_shutdown, crash_shutdown, cannot_connect_now
		return fmt.Errorf("%s: %w: the server is shutting down or restarting: %w", prefix, sqllock.ErrUnavailable, err)
	case code == "57014" && ctx.Err() != nil: // query_canceled by our context
		return fmt.Errorf("%s: canceled, not applied: %w", prefix, errors.Join(ctx.Err(), err))
	case code == "57014": // query_canceled: statement_timeout, or a cancel request
		return fmt.Errorf("%s: %w: the statement was canceled (statement_timeout?), not applied: %w", prefix, sqllock.ErrUnavailable, err)
	case code == "55P03": // lock_not_available: lock_timeout
		return fmt.Errorf("%s: %w: timed out waiting for a row lock (lock_timeout), not applied: %w", prefix, sqllock.ErrUnavailable, err)
	case code == "40001" || code == "40P01": // serialization_failure, deadlock_detected
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
	case strings.HasPrefix(code, "08"), strings.HasPrefix(code, "53"): // connection exception, insufficient resources
		return fmt.Errorf("%s: %w: %w", prefix, sqllock.ErrUnavailable, err)
	}
	return fmt.Errorf("%s: %w", prefix, err)
}

// isConnectionError reports a broken or closed connection (not a server
// error).
func isConnectionError(err error) bool {
	if errors.Is(err, pgconn.ErrConnClosed) || errors.Is(err, net.ErrClosed) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) ||
		errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNREFUSED) {
		return true
	}
	_, ok := errors.AsType[net.Error](err)
	return ok
}

// missingColumn reports the server's refusal of a statement that names a
// column of a later migration (00003's "waited", 00004's "value", 00005's
// "hold_until") on a table that does not have it.
func missingColumn(err error, column string) bool {
	pgErr, ok := errors.AsType[*pgconn.PgError](err)
	// `column "value" of relation ... does not exist`, `column c.value does not exist`
	return ok && pgErr.Code == "42703" &&
		(strings.Contains(pgErr.Message, `"`+column+`"`) || strings.Contains(pgErr.Message, "."+column+" "))
}

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
