package memory

import (
	"bytes"
	"context"
	"math"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

var _ sqllock.PermitAcquirer = (*Backend)(nil)

// TryAcquirePermit implements [sqllock.PermitAcquirer]: under the one
// lock, it takes the lowest free permit of the semaphore, creating the
// semaphore's limit and permits on its first grant.
func (b *Backend) TryAcquirePermit(ctx context.Context, req sqllock.PermitRequest) (sqllock.Lease, error) {
	if err := req.Validate(); err != nil {
		return sqllock.Lease{}, err
	}
	if err := ctx.Err(); err != nil {
		return sqllock.Lease{}, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	limitKey := sqllock.LimitKey(req.Key)
	if lim := b.keys[limitKey]; lim == nil {
		b.keys[limitKey] = &entry{token: int64(req.Permits), deadline: now}
		for i := 1; i <= req.Permits; i++ {
			b.keys[sqllock.PermitKey(req.Key, i)] = &entry{token: 1, deadline: now}
		}
	} else if lim.token != int64(req.Permits) {
		return sqllock.Lease{}, &sqllock.PermitLimitError{Key: req.Key, Asked: req.Permits, Stored: int(lim.token)}
	}
	var free *entry
	freeKey := ""
	exhausted := false
	var holders []sqllock.PermitHolder
	for i := 1; i <= req.Permits; i++ {
		k := sqllock.PermitKey(req.Key, i)
		e := b.keys[k]
		switch {
		case e.held && now.Before(e.deadline) && e.owner == req.Owner:
			// A retry of this very acquire: same grant, extended.
			e.deadline = now.Add(req.TTL)
			return b.lease(k, e, now), nil
		case e.held && now.Before(e.deadline):
			holders = append(holders, sqllock.PermitHolder{Key: k, Owner: e.owner, Token: e.token, Remaining: e.deadline.Sub(now), Value: bytes.Clone(e.value)})
		case e.token == math.MaxInt64:
			exhausted = true
		case free == nil:
			free, freeKey = e, k
		}
	}
	if free == nil {
		if exhausted {
			return sqllock.Lease{}, sqllock.ErrTokenExhausted
		}
		return sqllock.Lease{}, sqllock.NewPermitsHeldError(req.Key, req.Permits, holders)
	}
	grant(free, req.AcquireRequest, now)
	return b.lease(freeKey, free, now), nil
}

// grant gives e a new tenure for req at now (req.MinHold is zero).
func grant(e *entry, req sqllock.AcquireRequest, now time.Time) {
	e.token++
	e.held = true
	e.holdUntil = time.Time{}
	e.deadline = now.Add(req.TTL)
	e.owner = req.Owner
	e.value = nil
	if len(req.Value) > 0 {
		e.value = bytes.Clone(req.Value)
	}
}

// signal wakes the watchers of key and, for a permit, of its semaphore.
func (b *Backend) signal(key string) {
	b.signals.Signal(key)
	if sem, _, ok := sqllock.ParsePermitKey(key); ok {
		b.signals.Signal(sem)
	}
}
