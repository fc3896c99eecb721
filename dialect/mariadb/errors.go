package mariadb

import (
	"context"
	"database/sql/driver"
	"errors"
	"fmt"
	"net"

	"github.com/go-sql-driver/mysql"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

const dialect = outcome.Dialect("sqllock/mariadb")

var errClosed = fmt.Errorf("sqllock/mariadb: backend closed: %w", sqllock.ErrClosed)

// MariaDB's error numbers that ashlock reads.
const (
	erLockDeadlock   = 1213 // the transaction was rolled back: retried
	erLockWait       = 1205 // the statement was rolled back
	erNoSuchTable    = 1146
	erBadField       = 1054 // a table of another (older) layout
	erOutOfRange     = 1690 // token + 1 at the largest BIGINT
	erSignal         = 1644 // a trigger's SIGNAL (migrations 00002, 00003)
	erInterrupted    = 1317 // KILL QUERY, max_statement_time
	erReadOnly       = 1290 // --read-only
	erReadOnlyTx     = 1792
	erTooManyConns   = 1040
	erServerShutdown = 1053
)

// classify turns err of operation op on key into ashlock's vocabulary,
// once, at the backend's boundary. sent says the request may have left
// (false: it failed before the statement was started).
func classify(ctx context.Context, op outcome.Op, key string, err error) error {
	var me *mysql.MySQLError
	if errors.As(err, &me) {
		p := dialect.Prefix(op, key)
		switch me.Number {
		case erNoSuchTable, erBadField:
			return fmt.Errorf("%s: %w: %w", p, sqllock.ErrSchemaMissing, err)
		case erOutOfRange:
			if op == outcome.Acquire {
				return fmt.Errorf("%s: %w: %w", p, sqllock.ErrTokenExhausted, err)
			}
		case erLockDeadlock, erLockWait, erInterrupted, erReadOnly, erReadOnlyTx, erTooManyConns, erServerShutdown:
			// The server answered and rolled the statement back.
			return fmt.Errorf("%s: %w: not applied: %w", p, sqllock.ErrUnavailable, err)
		}
		// Refused by the server (a trigger's SIGNAL, a privilege, ...):
		// nothing applied, and repeating it would not help.
		return fmt.Errorf("%s: refused, not applied: %w", p, err)
	}
	ended := ctx.Err() != nil
	var oe *net.OpError
	if errors.Is(err, driver.ErrBadConn) || errors.As(err, &oe) && oe.Op == "dial" {
		// database/sql gives driver.ErrBadConn back only when the driver
		// said nothing was sent; a dial error sent nothing.
		return dialect.NotSent(op, key, ended && isCtxErr(err), err)
	}
	return dialect.InFlight(op, key, ended, err)
}

func isCtxErr(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}

// isFloorRace reports whether err is migration 00005's refusal of a first
// row at or below the floor (SQLSTATE 40001 from its SIGNAL, error 1644):
// a reap committed between the statement's read of the floor and its
// insert. The statement applied nothing, and its resend reads the new
// floor.
func isFloorRace(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && me.Number == erSignal && string(me.SQLState[:]) == "40001"
}

// isDeadlock reports whether err is InnoDB's deadlock (1213): the
// statement's transaction was rolled back, nothing applied.
func isDeadlock(err error) bool {
	var me *mysql.MySQLError
	return errors.As(err, &me) && me.Number == erLockDeadlock
}
