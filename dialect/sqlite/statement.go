package sqlite

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"sync"
	"sync/atomic"
)

// queryRow runs a statement that returns at most one row, scans it into
// dest, and reads on to the end: for an autocommit write with RETURNING,
// the step after the last row is the one that commits, so an error there
// is seen here and not lost in Close.
func (b *Backend) queryRow(ctx context.Context, query string, args []any, dest ...any) (found bool, err error) {
	stmt, err := b.stmt(ctx, query)
	if err != nil {
		return false, err
	}
	sctx, args, g, release := shield(ctx, args)
	defer release()
	rows, err := stmt.QueryContext(sctx, args...)
	if err != nil {
		return false, g.notSent(err)
	}
	defer rows.Close()
	for rows.Next() {
		if found {
			return true, fmt.Errorf("sqllock/sqlite: more than one row from %q", query)
		}
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

// stmt returns query prepared on b.db. Statements are prepared on first use,
// not in New, because the application may create the table later; a failed
// prepare is not cached.
func (b *Backend) stmt(ctx context.Context, query string) (*sql.Stmt, error) {
	b.stmtMu.Lock()
	defer b.stmtMu.Unlock()
	if b.closed.Load() {
		return nil, errClosed
	}
	if s := b.stmts[query]; s != nil {
		return s, nil
	}
	s, err := b.db.PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	b.stmts[query] = s
	return s, nil
}

// shield returns the context and arguments to run one statement with, so
// that ctx bounds the wait for a connection (an application's busy pool)
// but never interrupts the statement once it runs: an interrupted write's
// outcome would be unknown, and a statement lasts at most the busy timeout
// plus one commit. database/sql converts the arguments with the connection
// in hand, right before it hands the statement to the driver; the first
// argument's conversion closes the gate. If ctx ends before that, the
// statement is not sent: the wait for a connection ends (database/sql
// reports the cancelled statement context, a prepared statement's usual
// case) or the conversion refuses (when ctx ends just as the connection
// comes), and notSent turns either into a *notSentError with ctx's cause.
// Call release when the statement's rows are closed.
func shield(ctx context.Context, args []any) (sctx context.Context, gated []any, g *gate, release func()) {
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, cancel)
	g = &gate{ctx: ctx, stop: stop}
	gated = append([]any{gatedArg{v: args[0], g: g}}, args[1:]...)
	return sctx, gated, g, func() { stop(); cancel() }
}

// gate is shut by the first conversion of its statement's arguments.
type gate struct {
	ctx  context.Context
	stop func() bool
	once sync.Once
	shut atomic.Bool // the caller's context can no longer cancel the statement
}

// notSent returns err, or a *notSentError when err came before the
// statement reached the driver and the caller's context had ended.
func (g *gate) notSent(err error) error {
	if err != nil && !g.shut.Load() && g.ctx.Err() != nil {
		return &notSentError{cause: context.Cause(g.ctx)}
	}
	return err
}

// gatedArg is a statement argument whose conversion shuts its gate.
type gatedArg struct {
	v any
	g *gate
}

// Value implements [driver.Valuer]. database/sql may convert the arguments
// more than once (a retry on a bad connection): the first call decides.
func (a gatedArg) Value() (driver.Value, error) {
	a.g.once.Do(func() { a.g.shut.Store(a.g.stop()) })
	if !a.g.shut.Load() {
		return nil, &notSentError{cause: context.Cause(a.g.ctx)}
	}
	return driver.DefaultParameterConverter.ConvertValue(a.v)
}
