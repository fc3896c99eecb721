package postgres

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// translate turns a pgx error into the sqllock error that describes it, once,
// at the backend boundary: the sentinels for the classes callers act on
// (internal/outcome for a request not sent or failed in flight), with a
// message that says what happened, wrapping the original error.
func (b *Backend) translate(ctx context.Context, o outcome.Op, key string, err error) error {
	prefix := pg.Prefix(o, key)
	if errors.Is(err, ErrPoolerSettings) {
		return fmt.Errorf("%s: not applied: %w", prefix, err)
	}
	if ue, ok := errors.AsType[*unsettledError](err); ok {
		// The reply said it committed; a failover may still lose it.
		return fmt.Errorf("%s: %w: %w: the server answered that it committed, but perhaps without waiting for the synchronous standbys "+
			"(PostgreSQL commits locally and only warns when that wait is cancelled), so a failover may lose it", prefix, o.Unknown(), ue)
	}
	if o == outcome.Commit {
		// Only the server's answer that the COMMIT failed (an ERROR: it
		// rolled back) is a known outcome. A COMMIT that waits for a
		// synchronous standby has committed locally, and a server that
		// ends the session meanwhile (pg_terminate_backend, pg_ctl stop
		// -m immediate in a failover: FATAL 57P01) answers with that;
		// pgx may then report the connection closed, which it calls
		// safe to retry; and a COMMIT that failed with the context may
		// have been applied too (pgx#2110). None of them says the commit
		// was not applied.
		if pgErr, ok := errors.AsType[*pgconn.PgError](err); !ok || sessionEnded(pgErr) {
			return fmt.Errorf("%s: %w: the session ended around the commit, which may have been applied: %w",
				prefix, sqllock.ErrIndeterminate, err)
		}
	}
	if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok {
		// The server answered: the statement failed and was rolled back
		// (a failed COMMIT too), so the outcome is known.
		return translatePg(ctx, prefix, b.table, pgErr, err)
	}
	if _, ok := errors.AsType[*pgconn.ConnectError](err); ok {
		return fmt.Errorf("%s: %w: cannot connect to the database: %w", prefix, sqllock.ErrUnavailable, err)
	}
	if pgconn.SafeToRetry(err) {
		return pg.NotSent(o, key, ctx.Err() != nil, err)
	}
	if ctx.Err() != nil || pgconn.Timeout(err) || isConnectionError(err) {
		return pg.InFlight(o, key, ctx.Err() != nil, err)
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
		return conflict(prefix, code, err)
	case strings.HasPrefix(code, "08"), strings.HasPrefix(code, "53"): // connection exception, insufficient resources
		return fmt.Errorf("%s: %w: %w", prefix, sqllock.ErrUnavailable, err)
	}
	return fmt.Errorf("%s: %w", prefix, err)
}

// sessionEnded reports a server error that ends the session (FATAL or
// PANIC, or a shutdown: class 57P) rather than reporting a statement's
// failure.
func sessionEnded(pgErr *pgconn.PgError) bool {
	severity := cmp.Or(pgErr.SeverityUnlocalized, pgErr.Severity) // SeverityUnlocalized: PostgreSQL >= 9.6
	return severity == "FATAL" || severity == "PANIC" || strings.HasPrefix(pgErr.Code, "57P")
}
