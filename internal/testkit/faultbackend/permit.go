package faultbackend

import (
	"context"
	"fmt"

	"github.com/ashlock/ashlock/internal/testkit/history"
	"github.com/ashlock/ashlock/sqllock"
)

var _ sqllock.PermitAcquirer = (*Backend)(nil)

// TryAcquirePermit implements [sqllock.PermitAcquirer] through the fault
// schedule, as TryAcquire: recorded as an acquire of the semaphore's key,
// whose grant (op and audit) names the permit's key.
func (b *Backend) TryAcquirePermit(ctx context.Context, req sqllock.PermitRequest) (sqllock.Lease, error) {
	if err := req.Validate(); err != nil {
		return sqllock.Lease{}, err
	}
	p, ok := b.db.inner.(sqllock.PermitAcquirer)
	if !ok {
		return sqllock.Lease{}, fmt.Errorf("faultbackend: the inner backend %T has no permits", b.db.inner)
	}
	op := history.Op{Kind: history.Acquire, Key: req.Key, Owner: req.Owner, TTL: req.TTL}
	return b.call(ctx, op, func(ctx context.Context) (sqllock.Lease, error) { return p.TryAcquirePermit(ctx, req) })
}
