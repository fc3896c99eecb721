package mariadb

import (
	"context"
	"database/sql"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// FencedTx runs fn in a transaction that commits only while lease l is
// held: for a resource in the same database as the lock table, a stronger
// fence than comparing tokens.
//
// It begins a READ COMMITTED transaction on the Backend's handle, locks
// l's row in share mode (LOCK IN SHARE MODE) and goes on if and only if l
// is held with its token and an unexpired deadline by the database clock,
// runs fn, and commits. From the share lock until the commit, no acquire
// can grant the key to anyone else (an acquire's update waits on the share
// lock, at most [Options.LockWait]), even if the deadline passes
// meanwhile; so everything fn wrote was written under l. If l is no longer
// valid, FencedTx rolls back without calling fn and returns a
// [*sqllock.LostError] (matching [sqllock.ErrLeaseLost]) with the reason.
//
// Keep fn short: while it runs, this lease's renewals and any takeover of
// the key wait for it too. fn must not commit or roll back tx. If fn returns
// an error the transaction is rolled back and that error returned as is. A
// commit whose reply is lost (context ended, connection broke) returns an
// error matching [sqllock.ErrIndeterminate].
func (b *Backend) FencedTx(ctx context.Context, l sqllock.Lease, fn func(tx *sql.Tx) error) error {
	if err := sqllock.ValidateLease(l); err != nil {
		return err
	}
	if b.closed.Load() {
		return errClosed
	}
	if err := ctx.Err(); err != nil {
		return dialect.NotSent(outcome.Fence, l.Key, true, err)
	}
	tx, err := b.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return classify(ctx, outcome.Fence, l.Key, err)
	}
	committed := false
	defer func() {
		if !committed {
			_ = tx.Rollback()
		}
	}()
	var (
		locked, held  bool
		current       int64
		deadline, now int64
		owner         string
	)
	err = tx.QueryRowContext(ctx, b.fenceSQL, l.Token, l.Key).Scan(&locked, &current, &held, &deadline, &owner, &now)
	if err == sql.ErrNoRows {
		return sqllock.KeyState{}.Loss(l)
	}
	if err != nil {
		return classify(ctx, outcome.Fence, l.Key, err)
	}
	if !locked {
		st := sqllock.KeyState{Found: true, Token: current, Held: held, Expired: deadline <= now, Owner: owner}
		if lost := st.Loss(l); lost != nil {
			return lost
		}
		return &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostExpired}
	}
	if err := fn(tx); err != nil {
		return err
	}
	committed = true // from here on Commit ends the transaction either way
	if err := tx.Commit(); err != nil {
		return classify(ctx, outcome.Commit, l.Key, err)
	}
	return nil
}
