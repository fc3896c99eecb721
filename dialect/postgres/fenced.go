package postgres

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// FencedTx runs fn in a transaction that commits only while lease l is held:
// for a resource in the same database as the lock table, this is a stronger
// fence than comparing tokens.
//
// It begins a transaction on the pool, locks l's row FOR SHARE if and only if
// l is held with its token and an unexpired deadline by the database clock,
// runs fn, and commits. From the share lock until the commit, no acquire can
// grant the key to anyone else (an acquire's UPDATE waits on the share lock),
// even if the deadline passes meanwhile; so everything fn wrote was written
// under l. If l is no longer valid, FencedTx rolls back without calling fn
// and returns a [*sqllock.LostError] (matching [sqllock.ErrLeaseLost]) with
// the reason.
//
// Keep fn short: while it runs, this lease's renewals and any takeover of
// the key wait for it too. fn must not commit or roll back tx. If fn returns
// an error the transaction is rolled back and that error returned as is. A
// commit whose reply is lost (context ended, connection broke) returns an
// error matching [sqllock.ErrIndeterminate], and so does a commit that
// succeeded after its context ended or with a WARNING (see [OnNotice]): its
// wait for synchronous standbys may have been cancelled, and a failover
// could lose it. The transaction commits with the session's
// synchronous_commit: the durability of fn's writes is the application's
// choice.
func (b *Backend) FencedTx(ctx context.Context, l sqllock.Lease, fn func(tx pgx.Tx) error) (err error) {
	if err := sqllock.ValidateLease(l); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return pg.NotSent(outcome.Fence, l.Key, true, err)
	}
	if b.db != nil {
		return fmt.Errorf("%s: FencedTx runs on a pgx pool; this Backend is on a *sql.DB (NewDB): use FencedSQLTx", pg.Prefix(outcome.Fence, l.Key))
	}
	st, serr := b.statements(ctx, outcome.Fence, l.Key)
	if serr != nil {
		return serr
	}
	// Take the connection explicitly: one that the server condemned
	// (read-only after a failover, see unusable) is closed, not handed
	// back for reuse.
	conn, _, err := b.checkedConn(ctx, "")
	if err != nil {
		return b.translate(ctx, outcome.Fence, l.Key, err)
	}
	defer func() {
		// After the rollback below (deferred later, run earlier).
		if unusable(err) {
			discard(ctx, conn.Conn())
		}
		conn.Release()
	}()
	tx, err := conn.Begin(ctx)
	if err != nil {
		return b.translate(ctx, outcome.Fence, l.Key, err)
	}
	committed := false
	defer func() {
		if committed {
			return
		}
		// A rollback whose context has ended would close the connection;
		// give it its own short deadline instead.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		defer cancel()
		_ = tx.Rollback(rctx)
	}()
	var (
		locked, held  bool
		current       int64
		deadline, now time.Time
	)
	if err := tx.QueryRow(ctx, st.fence, fenceArgs(st, l)...).Scan(&locked, &current, &held, &deadline, &now); err != nil {
		return b.translate(ctx, outcome.Fence, l.Key, err)
	}
	if !locked {
		return lostReason(l, current, held, deadline, now)
	}
	if err := fn(tx); err != nil {
		return err
	}
	committed = true // from here on Commit ends the transaction either way
	clearWarning(conn.Conn().PgConn())
	if err := tx.Commit(ctx); err != nil {
		return b.translate(ctx, outcome.Commit, l.Key, err)
	}
	// Committed, but maybe without waiting for the synchronous standbys
	// (syncwait.go).
	if err := unsettled(ctx, conn.Conn().PgConn()); err != nil {
		return b.translate(ctx, outcome.Commit, l.Key, err)
	}
	return nil
}

// FencedSQLTx is [Backend.FencedTx] for a Backend on a *sql.DB ([NewDB]):
// fn gets a *sql.Tx of the Backend's *sql.DB (GORM, sqlx, ent and bun can
// each run their queries on it: see the README), begun, fenced by l's row
// FOR SHARE with its token and a live deadline, and committed after fn
// only while the lease holds, with the same errors as FencedTx. fn must
// not commit or roll back tx.
func (b *Backend) FencedSQLTx(ctx context.Context, l sqllock.Lease, fn func(tx *sql.Tx) error) (err error) {
	if err := sqllock.ValidateLease(l); err != nil {
		return err
	}
	if b.db == nil {
		return fmt.Errorf("%s: FencedSQLTx runs on a *sql.DB; this Backend is on a pgx pool (New): use FencedTx", pg.Prefix(outcome.Fence, l.Key))
	}
	if err := ctx.Err(); err != nil {
		return pg.NotSent(outcome.Fence, l.Key, true, err)
	}
	conn, err := b.connDB(ctx)
	if err != nil {
		return b.translate(ctx, outcome.Fence, l.Key, err)
	}
	defer func() {
		if unusable(err) {
			_ = conn.Raw(func(any) error { return driver.ErrBadConn })
		}
		conn.Close()
	}()
	if err := b.checkPoolerDB(ctx, conn); err != nil {
		return b.translate(ctx, outcome.Fence, l.Key, b.driverError(err))
	}
	tx, err := conn.BeginTx(ctx, nil)
	if err != nil {
		return b.translate(ctx, outcome.Fence, l.Key, b.driverError(err))
	}
	committed := false
	defer func() {
		if !committed {
			_ = tx.Rollback()
		}
	}()
	if err := b.Fence(ctx, tx, l); err != nil {
		return err
	}
	if err := fn(tx); err != nil {
		return err
	}
	committed = true // from here on Commit ends the transaction either way
	if b.pgxDriver {
		_ = conn.Raw(func(dc any) error { clearWarning(pgConnOf(dc)); return nil })
	}
	if err := tx.Commit(); err != nil {
		return b.translate(ctx, outcome.Commit, l.Key, b.driverError(err))
	}
	if b.pgxDriver {
		// A WARNING OnNotice kept: the commit's wait for the synchronous
		// standbys was cancelled (syncwait.go).
		var warned error
		_ = conn.Raw(func(dc any) error { warned = unsettled(context.Background(), pgConnOf(dc)); return nil })
		if warned != nil {
			return b.translate(ctx, outcome.Commit, l.Key, warned)
		}
	}
	if ctxErr := ctx.Err(); ctxErr != nil {
		// Committed after the context ended: maybe without waiting for
		// the synchronous standbys (syncwait.go).
		return b.translate(ctx, outcome.Commit, l.Key, &unsettledError{ctxErr: ctxErr})
	}
	return nil
}

// Fence locks lease l's row FOR SHARE in tx, a transaction of the
// application's own on the lock table's database (a *sql.Tx of any
// library built on database/sql), if and only if l is held with its token
// and a live deadline by the database clock: from then until tx ends, no
// acquire can grant the key to anyone else, so whatever tx writes and
// commits was written under l. If l is no longer valid it returns a
// [*sqllock.LostError] and tx should be rolled back. The commit is the
// caller's: one whose reply is lost, or that returns after ctx ended, may
// have applied ([Backend.FencedSQLTx] reports that as
// [sqllock.ErrIndeterminate]). Fence works on a Backend of either
// constructor; it sends one statement on tx.
func (b *Backend) Fence(ctx context.Context, tx *sql.Tx, l sqllock.Lease) error {
	if err := sqllock.ValidateLease(l); err != nil {
		return err
	}
	if tx == nil {
		return fmt.Errorf("%s: nil *sql.Tx", pg.Prefix(outcome.Fence, l.Key))
	}
	if err := ctx.Err(); err != nil {
		return pg.NotSent(outcome.Fence, l.Key, true, err)
	}
	st, err := b.statements(ctx, outcome.Fence, l.Key)
	if err != nil {
		return err
	}
	var (
		locked, held  bool
		current       int64
		deadline, now time.Time
	)
	if err := tx.QueryRowContext(ctx, st.fence, fenceArgs(st, l)...).Scan(&locked, &current, &held, &deadline, &now); err != nil {
		return b.translate(ctx, outcome.Fence, l.Key, b.driverError(err))
	}
	if !locked {
		return lostReason(l, current, held, deadline, now)
	}
	return nil
}

// fenceArgs are st's fence statement's arguments for l: from version 7
// (shared locks) also the key whose reader slot l is, or NULL.
func fenceArgs(st *statements, l sqllock.Lease) []any {
	if st.version < 7 {
		return []any{l.Key, l.Token}
	}
	if k, _, ok := sqllock.ParseSharedKey(l.Key); ok {
		return []any{l.Key, l.Token, k}
	}
	return []any{l.Key, l.Token, nil}
}
