package mariadb

import (
	"context"
	"database/sql"
	"fmt"
	"time"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/internal/wait"
)

// deadlockRetries bounds how often one operation is repeated after
// InnoDB chose its statement as a deadlock's victim (1213: rolled back,
// nothing applied).
const deadlockRetries = 10

// stmt returns the prepared statement for query, preparing it on first
// use (the table may not exist when the Backend is made). database/sql
// prepares it once per pooled connection, so each operation afterwards is
// one round trip (COM_STMT_EXECUTE), whatever the DSN's interpolateParams.
func (b *Backend) stmt(ctx context.Context, query string) (*sql.Stmt, error) {
	b.stmtMu.Lock()
	defer b.stmtMu.Unlock()
	if s, ok := b.stmts[query]; ok {
		return s, nil
	}
	s, err := b.db.PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	b.stmts[query] = s
	return s, nil
}

// run runs fn, the sending of one statement of operation op on key, and
// classifies its error: a context that ended before it starts is "not
// sent", a deadlock is retried (with a short jittered sleep), and so is a
// first row that a reap's committed floor refused (isFloorRace), anything
// else goes to classify.
func (b *Backend) run(ctx context.Context, op outcome.Op, key string, fn func(ctx context.Context) error) error {
	if b.closed.Load() {
		return errClosed
	}
	for attempt := 0; ; attempt++ {
		if err := ctx.Err(); err != nil {
			return dialect.NotSent(op, key, true, err)
		}
		err := fn(ctx)
		if err == nil {
			return nil
		}
		if isFloorRace(err) && attempt < deadlockRetries {
			continue // nothing was applied; the resend reads the new floor
		}
		if isDeadlock(err) && attempt < deadlockRetries {
			b.deadlocks.Add(1)
			if wait.Sleep(ctx, time.Duration(attempt+1)*time.Millisecond) != nil {
				return dialect.NotSent(op, key, true, fmt.Errorf("%w (after a deadlock: %w)", ctx.Err(), err))
			}
			continue
		}
		return classify(ctx, op, key, err)
	}
}

// queryRow runs query (prepared) with args and scans its one row into
// dest; found is false when it returned none.
func (b *Backend) queryRow(ctx context.Context, query string, args []any, dest ...any) (found bool, err error) {
	s, err := b.stmt(ctx, query)
	if err != nil {
		return false, err
	}
	rows, err := s.QueryContext(ctx, args...)
	if err != nil {
		return false, err
	}
	defer rows.Close()
	if rows.Next() {
		if err := rows.Scan(dest...); err != nil {
			return false, err
		}
		found = true
	}
	if err := rows.Err(); err != nil {
		return false, err
	}
	return found, rows.Close()
}

// queryEach runs query (prepared) with args and calls scan on each row
// of its reply, stopping at the first error: the batch statements'
// (acquire, release, renewal) one way of reading their rows.
func (b *Backend) queryEach(ctx context.Context, query string, args []any, scan func(*sql.Rows) error) error {
	s, err := b.stmt(ctx, query)
	if err != nil {
		return err
	}
	rows, err := s.QueryContext(ctx, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		if err := scan(rows); err != nil {
			return err
		}
	}
	if err := rows.Err(); err != nil {
		return err
	}
	return rows.Close()
}
