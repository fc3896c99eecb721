package memory

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

var _ sqllock.MultiAcquirer = (*Backend)(nil)

// TryAcquireAll implements [sqllock.MultiAcquirer]: every key is judged,
// in ascending order, under the one lock and at one instant, and only
// when none refuses is any of them granted.
func (b *Backend) TryAcquireAll(ctx context.Context, req sqllock.MultiAcquireRequest) ([]sqllock.Lease, error) {
	if err := req.Validate(); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	for _, k := range sqllock.SortedKeys(req.Keys) {
		e := b.keys[k]
		switch {
		case e == nil:
		case e.held && now.Before(e.deadline) && e.owner == req.Owner:
			// A retry of this very request: this key keeps its grant.
		case e.held && now.Before(e.deadline),
			!e.held && now.Before(e.holdUntil) && now.Before(e.deadline): // released inside its min hold
			return nil, &sqllock.HeldError{
				Key: k, Owner: e.owner, Token: e.token, Remaining: e.deadline.Sub(now), Value: bytes.Clone(e.value),
			}
		case e.token == math.MaxInt64:
			return nil, fmt.Errorf("%w: %q reached token %d", sqllock.ErrTokenExhausted, k, e.token)
		}
	}
	out := make([]sqllock.Lease, len(req.Keys))
	for i, k := range req.Keys {
		e := b.keys[k]
		switch {
		case e == nil:
			e = &entry{token: b.floor}
			b.keys[k] = e
		case e.held && now.Before(e.deadline) && e.owner == req.Owner:
			e.deadline = later(now.Add(req.TTL), e.holdUntil)
			out[i] = b.lease(k, e, now)
			continue
		}
		e.token++
		e.held = true
		e.holdUntil = time.Time{}
		e.deadline = now.Add(req.TTL)
		e.owner = req.Owner
		e.value = nil
		if len(req.Value) > 0 {
			e.value = bytes.Clone(req.Value)
		}
		out[i] = b.lease(k, e, now)
	}
	return out, nil
}

var _ sqllock.MultiReleaser = (*Backend)(nil)

// ReleaseAll implements [sqllock.MultiReleaser]: every lease released as
// Release would, in key order, at one instant, under one hold of the lock.
func (b *Backend) ReleaseAll(ctx context.Context, ls []sqllock.Lease) ([]error, error) {
	if err := sqllock.ValidateReleaseAll(ls); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	order := make([]int, len(ls))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(i, j int) int { return strings.Compare(ls[i].Key, ls[j].Key) })
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	out := make([]error, len(ls))
	for _, i := range order {
		out[i] = b.releaseLocked(ls[i], now)
	}
	return out, nil
}
