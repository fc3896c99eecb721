package mariadb

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// TryRenewBatch implements [sqllock.BatchRenewer] with one statement
// (renewBatchSQL), one commit, at one instant of the database clock, for
// the whole batch. Each key is renewed once: with its largest token among
// the batch's leases (a smaller one is an older tenure, which cannot be
// current while the larger exists) and the longest TTL asked for that
// lease. A batch of unknown outcome is [sqllock.ErrUnavailable] for every
// lease: repeating it is safe.
func (b *Backend) TryRenewBatch(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
	if err := sqllock.ValidateRenewBatch(reqs); err != nil {
		return nil, err
	}
	if len(reqs) == 0 {
		return nil, nil
	}
	type ask struct{ token, us int64 }
	asks := make(map[string]ask, len(reqs))
	for _, r := range reqs {
		a, ok := asks[r.Lease.Key]
		us := leaseMicros(r.TTL)
		switch {
		case !ok || r.Lease.Token > a.token:
			asks[r.Lease.Key] = ask{r.Lease.Token, us}
		case r.Lease.Token == a.token:
			asks[r.Lease.Key] = ask{a.token, max(a.us, us)}
		}
	}
	elems := make([][3]any, 0, len(asks))
	for key, a := range asks {
		elems = append(elems, [3]any{key, a.token, a.us})
	}
	arg, err := json.Marshal(elems)
	if err != nil {
		return nil, err
	}
	type row struct {
		held                 bool
		token, deadline, now int64
	}
	rows := make(map[string]row, len(asks))
	var now int64
	err = b.run(ctx, outcome.Renew, reqs[0].Lease.Key, func(ctx context.Context) error {
		clear(rows)
		return b.queryEach(ctx, b.renewBatchSQL, []any{string(arg)}, func(rs *sql.Rows) error {
			var key string
			var r row
			if err := rs.Scan(&key, &r.token, &r.held, &r.deadline, &r.now); err != nil {
				return err
			}
			rows[key], now = r, r.now
			return nil
		})
	})
	if err != nil {
		if !errors.Is(err, sqllock.ErrUnavailable) && !errors.Is(err, sqllock.ErrSchemaMissing) {
			err = fmt.Errorf("%w: sqllock/mariadb: batch renewal: %w", sqllock.ErrUnavailable, err)
		}
		return nil, err
	}
	out := make([]sqllock.RenewResult, len(reqs))
	for j, rq := range reqs {
		l := rq.Lease
		r, found := rows[l.Key]
		if found && r.token == l.Token && r.held && r.deadline > r.now {
			l.Deadline, l.BackendTime = at(r.deadline), at(r.now)
			out[j].Lease = l
			continue
		}
		st := sqllock.KeyState{Found: found, Token: r.token, Held: r.held, Expired: r.deadline <= r.now}
		if lost := st.Loss(l); lost != nil {
			out[j].Err = lost
			continue
		}
		out[j].Err = fmt.Errorf("%w: sqllock/mariadb: batch renewal of %q: unexpected row (token %d, held %v, deadline %d, now %d)",
			sqllock.ErrUnavailable, l.Key, r.token, r.held, r.deadline, now)
	}
	return out, nil
}
