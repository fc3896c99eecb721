package postgres

import (
	"context"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
)

// A commit that waits for synchronous standbys (synchronous_standby_names
// set, synchronous_commit on or above, as grants and renewals always are:
// see queries.go) has already committed locally while it waits. When that
// wait is cancelled (a cancel request: pgx sends one when a context ends if
// the pool uses pgconn.CancelRequestContextWatcherHandler; an operator's
// pg_cancel_backend), PostgreSQL does not roll anything back: it sends
//
//	WARNING:  canceling wait for synchronous replication due to user request
//	DETAIL:  The transaction has already committed locally, but might not have been replicated to the standby.
//
// and answers as for a successful commit. Such a grant is lost if a standby
// that never received it is promoted, and its token is then granted again
// (G2); such a renewal moves the deadline back under its guard (G3). So a
// statement that succeeded is reported as of unknown outcome when its
// context ended while it was in flight (whichever context watcher the pool
// uses), or when the connection got a WARNING while it ran (seen only with
// [OnNotice] installed: pgx hands notices to the pool's ConnConfig.OnNotice
// alone).

// warningKey is where OnNotice keeps, in the connection's CustomData, the
// last WARNING the server sent; a statement clears it before it is sent.
const warningKey = "sqllock/postgres.warning"

// OnNotice returns a notice handler for the pool's ConnConfig.OnNotice that
// lets the Backend see the WARNING with which PostgreSQL reports a commit
// whose wait for synchronous standbys was cancelled, as by an operator's
// pg_cancel_backend (see [Backend.TryAcquire]); then it calls next, if not
// nil, with every notice. Without it, the Backend sees only cancellations
// that come from its own caller's context.
//
//	cfg, err := pgxpool.ParseConfig(url)
//	cfg.ConnConfig.OnNotice = postgres.OnNotice(cfg.ConnConfig.OnNotice)
func OnNotice(next pgconn.NoticeHandler) pgconn.NoticeHandler {
	return func(c *pgconn.PgConn, n *pgconn.Notice) {
		severity := n.SeverityUnlocalized // PostgreSQL >= 9.6
		if severity == "" {
			severity = n.Severity
		}
		if severity == "WARNING" {
			c.CustomData()[warningKey] = n
		}
		if next != nil {
			next(c, n)
		}
	}
}

// unsettledError is the error of a statement whose reply said it
// succeeded, but whose commit may not have waited for the synchronous
// standbys: a WARNING came with it, or its context ended in flight.
type unsettledError struct {
	warning *pgconn.Notice // nil when only the context ended
	ctxErr  error
}

func (e *unsettledError) Error() string {
	if e.warning != nil {
		return fmt.Sprintf("the server warned: %s", oneLine(e.warning.Message, e.warning.Detail))
	}
	return fmt.Sprintf("the context ended while the statement was in flight (%v)", e.ctxErr)
}

func (e *unsettledError) Unwrap() error { return e.ctxErr }

// clearWarning forgets a WARNING an earlier statement of conn got.
func clearWarning(conn *pgconn.PgConn) {
	delete(conn.CustomData(), warningKey)
}

// unsettled returns an *unsettledError when a statement on conn that
// succeeded may have committed without waiting for the synchronous
// standbys, nil otherwise.
func unsettled(ctx context.Context, conn *pgconn.PgConn) error {
	if n, ok := conn.CustomData()[warningKey].(*pgconn.Notice); ok {
		return &unsettledError{warning: n, ctxErr: ctx.Err()}
	}
	if err := ctx.Err(); err != nil {
		return &unsettledError{ctxErr: err}
	}
	return nil
}

func oneLine(msg, detail string) string {
	msg = strings.TrimSuffix(msg, ".")
	if detail == "" {
		return msg
	}
	return msg + ". " + strings.TrimSuffix(detail, ".")
}
