package mariadb

import (
	"context"
	"database/sql"
	"strings"
	"time"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

var _ sqllock.Reaper = (*Backend)(nil)

// Reap implements [sqllock.Reaper]: one short READ COMMITTED transaction
// that picks at most limit rows of keys whose lease ended at least
// olderThan ago by the database clock, locking them FOR UPDATE SKIP
// LOCKED (reapPickSQL: a row another transaction has locked is skipped,
// never waited for), marks itself as the reaper on the floor row
// (reapMarkSQL, which migration 00006's delete trigger requires), deletes
// them (reapDeleteSQL; the trigger raises the floor past each token),
// unmarks and commits. It needs migrations 00004 to 00006: on an older
// table it fails with [sqllock.ErrSchemaMissing] (the floor table is
// missing) or is refused by 00003's trigger, having deleted nothing.
func (b *Backend) Reap(ctx context.Context, olderThan time.Duration, limit int) (int, error) {
	if err := sqllock.ValidateReap(olderThan, limit); err != nil {
		return 0, err
	}
	var n int
	err := b.run(ctx, outcome.Reap, "", func(ctx context.Context) (err error) {
		n, err = b.reap(ctx, olderThan.Microseconds(), limit)
		return err
	})
	if err != nil {
		return 0, err
	}
	return n, nil
}

// reap is one attempt of Reap: its transaction, committed or rolled back.
func (b *Backend) reap(ctx context.Context, olderThan int64, limit int) (int, error) {
	tx, err := b.db.BeginTx(ctx, &sql.TxOptions{Isolation: sql.LevelReadCommitted})
	if err != nil {
		return 0, err
	}
	defer tx.Rollback() //nolint:errcheck // after Commit, or the error that ended it
	rows, err := tx.QueryContext(ctx, b.reapPickSQL, olderThan, limit)
	if err != nil {
		return 0, err
	}
	var keys []any
	for rows.Next() {
		var k []byte
		if err := rows.Scan(&k); err != nil {
			rows.Close()
			return 0, err
		}
		keys = append(keys, k)
	}
	if err := rows.Err(); err != nil {
		return 0, err
	}
	if err := rows.Close(); err != nil {
		return 0, err
	}
	if len(keys) == 0 {
		return 0, tx.Commit()
	}
	if _, err := tx.ExecContext(ctx, b.reapMarkSQL); err != nil {
		return 0, err
	}
	del := strings.Replace(b.reapDeleteSQL, "{{keys}}", strings.TrimSuffix(strings.Repeat("?, ", len(keys)), ", "), 1)
	res, err := tx.ExecContext(ctx, del, append(keys, olderThan)...)
	if err != nil {
		return 0, err
	}
	n, err := res.RowsAffected()
	if err != nil {
		return 0, err
	}
	if _, err := tx.ExecContext(ctx, b.reapUnmarkSQL); err != nil {
		return 0, err
	}
	if err := tx.Commit(); err != nil {
		return 0, err
	}
	return int(n), nil
}
