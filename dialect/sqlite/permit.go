package sqlite

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

var _ sqllock.PermitAcquirer = (*Backend)(nil)

// permitQueries are the semaphore's statements, rendered with the others.
type permitQueries struct {
	acquire, peek, create string
}

func renderPermitQueries(h holes) permitQueries {
	return permitQueries{
		acquire: fill(queryTemplates, "permit_acquire", h),
		peek:    fill(queryTemplates, "permit_peek", h),
		create:  fill(queryTemplates, "permit_create", h),
	}
}

// TryAcquirePermit implements [sqllock.PermitAcquirer]. A grant is one
// statement (permit_acquire). When it grants nothing, one read
// (permit_peek) tells a refusal (every permit held: the holders), a
// different limit, an exhausted token or a semaphore not yet created; the
// first grant of a semaphore creates it (permit_create) and grants again.
// Between the statements another process may have moved the rows: the
// attempt then starts again.
func (b *Backend) TryAcquirePermit(ctx context.Context, req sqllock.PermitRequest) (sqllock.Lease, error) {
	if err := req.Validate(); err != nil {
		return sqllock.Lease{}, err
	}
	var value any // NULL for no value
	if len(req.Value) > 0 {
		value = req.Value
	}
	var l sqllock.Lease
	var refused error
	err := b.write(ctx, outcome.Acquire, req.Key, func(ctx context.Context) error {
		var (
			key            string
			token, dl, now int64
			granted        []byte
		)
		found, err := b.queryRow(ctx, outcome.Acquire, b.permit.acquire,
			[]any{req.Key, leaseMillis(req.TTL), req.Owner, value, req.Permits}, &key, &token, &dl, &granted, &now)
		if err != nil {
			return err
		}
		if found {
			l = sqllock.Lease{Key: key, Token: token, Owner: req.Owner, Deadline: time.UnixMilli(dl), BackendTime: time.UnixMilli(now), Value: nonEmpty(granted)}
			return nil
		}
		refused, err = b.permitRefusal(ctx, req)
		return err
	})
	if err != nil {
		return sqllock.Lease{}, b.translate(err, true)
	}
	if refused != nil {
		return sqllock.Lease{}, refused
	}
	return l, nil
}

// permitRefusal reads the semaphore after a permit_acquire that granted
// nothing and returns why, or creates the semaphore and returns errRetry
// (as it does when the read shows a permit that could be granted now).
func (b *Backend) permitRefusal(ctx context.Context, req sqllock.PermitRequest) (error, error) {
	stmt, err := b.stmt(ctx, b.permit.peek)
	if err != nil {
		return nil, err
	}
	sctx, args, g, release := shield(ctx, outcome.Acquire, []any{req.Key, req.Permits})
	defer release()
	rows, err := stmt.QueryContext(sctx, args...)
	if err != nil {
		return nil, g.notSent(err)
	}
	defer rows.Close()
	limitKey := sqllock.LimitKey(req.Key)
	limit := int64(0)
	free, exhausted := false, false
	var holders []sqllock.PermitHolder
	for rows.Next() {
		var (
			h             sqllock.PermitHolder
			held          bool
			deadline, now int64
		)
		if err := rows.Scan(&h.Key, &h.Token, &held, &deadline, &h.Owner, &h.Value, &now); err != nil {
			return nil, err
		}
		switch {
		case h.Key == limitKey:
			limit = h.Token
		case held && deadline > now:
			h.Remaining, h.Value = remaining(deadline, now), nonEmpty(h.Value)
			holders = append(holders, h)
		case h.Token == math.MaxInt64:
			exhausted = true
		default:
			free = true
		}
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	if err := rows.Close(); err != nil {
		return nil, err
	}
	switch {
	case limit == 0:
		if _, err := b.exec(ctx, b.permit.create, req.Key, req.Permits); err != nil {
			return nil, err
		}
		return nil, errRetry
	case limit != int64(req.Permits):
		return &sqllock.PermitLimitError{Key: req.Key, Asked: req.Permits, Stored: int(limit)}, nil
	case free:
		return nil, errRetry // freed (or expired) since the grant's statement
	case exhausted:
		return fmt.Errorf("%w: semaphore %q", sqllock.ErrTokenExhausted, req.Key), nil
	}
	return sqllock.NewPermitsHeldError(req.Key, req.Permits, holders), nil
}

// exec runs a statement that returns no rows.
func (b *Backend) exec(ctx context.Context, query string, args ...any) (int64, error) {
	stmt, err := b.stmt(ctx, query)
	if err != nil {
		return 0, err
	}
	sctx, gated, g, release := shield(ctx, outcome.Acquire, args)
	defer release()
	res, err := stmt.ExecContext(sctx, gated...)
	if err != nil {
		return 0, g.notSent(err)
	}
	return res.RowsAffected()
}

// signal wakes the watchers of key and, for a permit, of its semaphore.
func (b *Backend) signal(key string) {
	b.signals.Signal(key)
	if sem, _, ok := sqllock.ParsePermitKey(key); ok {
		b.signals.Signal(sem)
	}
}
