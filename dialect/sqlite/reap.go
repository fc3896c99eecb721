package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

var _ sqllock.Reaper = (*Backend)(nil)

// Reap implements [sqllock.Reaper]: one write transaction (BEGIN
// IMMEDIATE; reap_begin, reap, reap_end; COMMIT) in the Backend's write
// slot. SQLite runs one write transaction at a time, so an acquire sees
// the keys and the floor either before the reap or after it, never the
// key gone and the floor not yet raised; migration 00005's trigger raises
// the floor in the deleting statement itself.
func (b *Backend) Reap(ctx context.Context, olderThan time.Duration, limit int) (int, error) {
	if err := sqllock.ValidateReap(olderThan, limit); err != nil {
		return 0, err
	}
	var n int64
	err := b.write(ctx, outcome.Reap, "", func(ctx context.Context) (err error) {
		n, err = b.reapTx(ctx, olderThan.Milliseconds(), limit)
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("sqllock/sqlite: Reap: %w", b.translate(err, true))
	}
	return int(n), nil
}

func (b *Backend) reapTx(ctx context.Context, olderMS int64, limit int) (n int64, err error) {
	conn, err := b.db.Conn(ctx)
	if err != nil {
		return 0, err
	}
	defer conn.Close()
	// Never interrupted once begun: a rollback is harmless, but an
	// interrupted statement would leave the transaction to the rollback.
	sctx := context.WithoutCancel(ctx)
	if _, err := conn.ExecContext(sctx, "BEGIN IMMEDIATE"); err != nil {
		return 0, err
	}
	defer func() {
		if err != nil {
			err = errors.Join(err, rollback(conn))
		}
	}()
	if _, err := conn.ExecContext(sctx, b.reapBeginSQL); err != nil {
		return 0, err
	}
	res, err := conn.ExecContext(sctx, b.reapSQL, olderMS, limit)
	if err != nil {
		return 0, err
	}
	if n, err = res.RowsAffected(); err != nil {
		return 0, err
	}
	if _, err := conn.ExecContext(sctx, b.reapEndSQL); err != nil {
		return 0, err
	}
	if _, err := conn.ExecContext(sctx, "COMMIT"); err != nil {
		return 0, err
	}
	return n, nil
}

// rollback ends the reap's transaction after a failure; an error here
// (no transaction left: SQLite rolled it back itself) is reported only
// with the first.
func rollback(conn *sql.Conn) error {
	if _, err := conn.ExecContext(context.Background(), "ROLLBACK"); err != nil && !isNoTx(err) {
		return err
	}
	return nil
}

func isNoTx(err error) bool {
	return strings.Contains(err.Error(), "no transaction is active")
}
