package sqlite

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// TryRenewBatch implements [sqllock.BatchRenewer]: one statement
// (renewBatchSQL) in one write transaction (BEGIN IMMEDIATE, with the read
// of the clock before it), at one instant of the database clock, and so one
// commit, one fsync with synchronous=FULL, for the whole batch. Each key is
// renewed once: with its largest token among the batch's leases (a smaller
// one is an older tenure, which cannot be current while the larger exists)
// and the longest TTL asked for that lease. A batch of unknown outcome is
// [sqllock.ErrUnavailable] for every lease: repeating it is safe.
func (b *Backend) TryRenewBatch(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
	if err := sqllock.ValidateRenewBatch(reqs); err != nil {
		return nil, err
	}
	if len(reqs) == 0 {
		return nil, nil
	}
	if slices.ContainsFunc(reqs, isShared) {
		return b.renewBatchWithShared(ctx, reqs)
	}
	type ask struct {
		token, ms int64
	}
	asks := make(map[string]ask, len(reqs))
	for _, r := range reqs {
		a, ok := asks[r.Lease.Key]
		ms := leaseMillis(r.TTL)
		switch {
		case !ok || r.Lease.Token > a.token:
			asks[r.Lease.Key] = ask{r.Lease.Token, ms}
		case r.Lease.Token == a.token:
			asks[r.Lease.Key] = ask{a.token, max(a.ms, ms)}
		}
	}
	elems := make([][3]any, 0, len(asks))
	for key, a := range asks {
		elems = append(elems, [3]any{key, a.token, a.ms})
	}
	arg, err := json.Marshal(elems)
	if err != nil {
		return nil, err
	}
	type row struct {
		held            bool
		token, deadline int64
	}
	rows := make(map[string]row, len(asks))
	var now int64
	err = b.write(ctx, outcome.Renew, reqs[0].Lease.Key, func(ctx context.Context) error {
		return b.inWriteTx(ctx, outcome.Renew, reqs[0].Lease.Key, func(conn *sql.Conn) error {
			clear(rows)
			if err := conn.QueryRowContext(ctx, b.nowSQL).Scan(&now); err != nil {
				return err
			}
			rs, err := conn.QueryContext(ctx, b.renewBatchSQL, string(arg), now)
			if err != nil {
				return err
			}
			defer rs.Close()
			for rs.Next() {
				var key string
				var r row
				if err := rs.Scan(&key, &r.token, &r.held, &r.deadline); err != nil {
					return err
				}
				rows[key] = r
			}
			return rs.Err()
		})
	})
	if err != nil {
		err = b.translate(err, true)
		if errors.Is(err, sqllock.ErrIndeterminate) || !errors.Is(err, sqllock.ErrUnavailable) && !errors.Is(err, sqllock.ErrSchemaMissing) {
			err = fmt.Errorf("%w: sqllock/sqlite: batch renewal: %w", sqllock.ErrUnavailable, err)
		}
		return nil, err
	}
	out := make([]sqllock.RenewResult, len(reqs))
	for j, rq := range reqs {
		l := rq.Lease
		r, found := rows[l.Key]
		if found && r.token == l.Token && r.held && r.deadline > now {
			l.Deadline, l.BackendTime = time.UnixMilli(r.deadline), time.UnixMilli(now)
			out[j].Lease = l
			continue
		}
		if lost := keyState(found, r.token, r.held, r.deadline, now, "").Loss(l); lost != nil {
			out[j].Err = lost
			continue
		}
		out[j].Err = fmt.Errorf("%w: sqllock/sqlite: batch renewal of %q: unexpected row (token %d, held %v, deadline %d, now %d)",
			sqllock.ErrUnavailable, l.Key, r.token, r.held, r.deadline, now)
	}
	return out, nil
}

// inWriteTx runs fn in a write transaction on a connection of its own,
// begun IMMEDIATE (the write lock at once, whatever the DSN's _txlock), and
// commits it, or rolls it back if fn fails. A connection it cannot get is
// operation o's not-sent error.
func (b *Backend) inWriteTx(ctx context.Context, o outcome.Op, key string, fn func(conn *sql.Conn) error) error {
	conn, err := b.db.Conn(ctx)
	if err != nil {
		return lite.NotSent(o, key, ctx.Err() != nil, err)
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, "BEGIN IMMEDIATE"); err != nil {
		return err
	}
	if err := fn(conn); err != nil {
		_, _ = conn.ExecContext(context.WithoutCancel(ctx), "ROLLBACK")
		return err
	}
	if _, err := conn.ExecContext(ctx, "COMMIT"); err != nil {
		_, _ = conn.ExecContext(context.WithoutCancel(ctx), "ROLLBACK")
		return err
	}
	return nil
}

// isShared reports whether r renews a shared lease (a reader slot's).
func isShared(r sqllock.RenewRequest) bool {
	_, _, ok := sqllock.ParseSharedKey(r.Lease.Key)
	return ok
}

// renewBatchWithShared renews the shared leases of reqs one by one (a
// reader's renewal moves its key's row too: shared_renew) and the others
// in one batch.
func (b *Backend) renewBatchWithShared(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
	out := make([]sqllock.RenewResult, len(reqs))
	var rest []sqllock.RenewRequest
	var at []int
	for i, r := range reqs {
		if !isShared(r) {
			rest, at = append(rest, r), append(at, i)
			continue
		}
		l, err := b.TryRenew(ctx, r.Lease, r.TTL)
		out[i] = sqllock.RenewResult{Lease: l, Err: err}
	}
	if len(rest) > 0 {
		res, err := b.TryRenewBatch(ctx, rest)
		if err != nil {
			return nil, err
		}
		for j, r := range res {
			out[at[j]] = r
		}
	}
	return out, nil
}
