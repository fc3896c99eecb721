package postgres

import (
	"context"
	"fmt"
	"time"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

var _ sqllock.Reaper = (*Backend)(nil)

// Reap implements [sqllock.Reaper] in one statement (queries/reap.sql), on
// the pgx pool or the *sql.DB alike. It needs migration 00006 (the token
// floor): on an older table it fails with [sqllock.ErrSchemaMissing]
// before anything is sent.
func (b *Backend) Reap(ctx context.Context, olderThan time.Duration, limit int) (int, error) {
	if err := sqllock.ValidateReap(olderThan, limit); err != nil {
		return 0, err
	}
	st, err := b.statements(ctx, outcome.Reap, "")
	if err != nil {
		return 0, err
	}
	if st.version < 6 {
		return 0, fmt.Errorf("%w: table %s lacks the token floor of migration 00006, which reaping needs (run `sqllock migrate up`, then rebuild the Backend)",
			sqllock.ErrSchemaMissing, b.table)
	}
	var n int64
	if err := b.queryRow(ctx, st.reap, []any{olderThan.Microseconds(), limit}, &n); err != nil {
		return 0, b.translate(ctx, outcome.Reap, "", err)
	}
	return int(n), nil
}
