package sqlite

import (
	"context"
	"fmt"
	"math"
	"time"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// sharedQueries are the statements of shared locks, rendered with the
// others (docs/shared-locks.md).
type sharedQueries struct {
	acquire, renew, release string
}

func renderSharedQueries(h holes) sharedQueries {
	return sharedQueries{
		acquire: fill(queryTemplates, "shared_acquire", h),
		renew:   fill(queryTemplates, "shared_renew", h),
		release: fill(queryTemplates, "shared_release", h),
	}
}

// tryAcquireShared grants a shared request with one statement
// (shared_acquire), which returns K's row and, on a grant, the slot's.
func (b *Backend) tryAcquireShared(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	if err := req.ValidateShared(); err != nil {
		return sqllock.Lease{}, err
	}
	var arg any // NULL for no value
	if len(req.Value) > 0 {
		arg = req.Value
	}
	type row struct {
		key                                string
		token, deadline, holdUntil, markDL int64
		now                                int64
		held                               bool
		owner, markOwner                   string
		value                              []byte
		shared                             int
	}
	var k, slot row
	granted := false
	err := b.write(ctx, outcome.Acquire, req.Key, func(ctx context.Context) error {
		granted = false
		var r row
		return b.queryRows(ctx, outcome.Acquire, b.shared.acquire, []any{req.Key, req.Key, leaseMillis(req.TTL), req.Owner, arg},
			[]any{&r.key, &r.token, &r.held, &r.deadline, &r.owner, &r.value, &r.holdUntil, &r.shared, &r.markOwner, &r.markDL, &r.now},
			func() {
				if r.key == req.Key {
					k = r
				} else {
					slot, granted = r, true
				}
			})
	})
	if err != nil {
		return sqllock.Lease{}, b.translate(err, true)
	}
	if granted {
		return sqllock.Lease{Key: slot.key, Token: slot.token, Owner: slot.owner, Deadline: time.UnixMilli(slot.deadline),
			BackendTime: time.UnixMilli(slot.now), Value: nonEmpty(slot.value)}, nil
	}
	now := k.now
	live := k.held && k.owner == "" && k.deadline > now
	marked := k.markOwner != "" && k.markDL > now
	waiting := ""
	if marked {
		waiting = k.markOwner
	}
	switch {
	case !live && ((k.held && k.deadline > now) || (!k.held && k.holdUntil > now && k.deadline > now)):
		return sqllock.Lease{}, &sqllock.HeldError{Key: req.Key, Owner: k.owner, Token: k.token,
			Remaining: remaining(k.deadline, now), Value: nonEmpty(k.value), WaitingWriter: waiting}
	case marked:
		he := &sqllock.HeldError{Key: req.Key, Remaining: remaining(k.markDL, now), WaitingWriter: waiting}
		if live {
			he.Shared, he.Token = k.shared, k.token
		}
		return sqllock.Lease{}, he
	case k.token == math.MaxInt64:
		return sqllock.Lease{}, fmt.Errorf("%w: key %q", sqllock.ErrTokenExhausted, req.Key)
	}
	return sqllock.Lease{}, &sqllock.HeldError{Key: req.Key, Token: k.token, Remaining: remaining(k.deadline, now), Shared: k.shared}
}

// sharedRow is a row shared_renew or shared_release returned.
type sharedRow struct {
	found                  bool
	token, deadline, epoch int64
	held                   bool
	owner                  string
	shared                 int
}

// sharedLoss is why shared lease l is not valid, by its slot's row s and
// its key's row k at now (after the statement), or nil.
func sharedLoss(l sqllock.Lease, s, k sharedRow, now int64) *sqllock.LostError {
	if lost := keyState(s.found, s.token, s.held, s.deadline, now, s.owner).Loss(l); lost != nil {
		return lost
	}
	return keyLoss(l, k, now)
}

// keyLoss is why shared lease l is not valid by its key's row k alone.
func keyLoss(l sqllock.Lease, k sharedRow, now int64) *sqllock.LostError {
	switch {
	case k.found && k.held && k.owner == "" && k.deadline > now && k.epoch <= l.Token:
		return nil
	case k.found && k.owner != "" && k.token > l.Token:
		return &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostTaken, Current: k.token}
	case k.found && k.held && k.owner == "" && k.deadline <= now:
		return &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostExpired}
	}
	return &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostReleased, By: k.owner}
}

// renewShared renews shared lease l of key with one statement.
func (b *Backend) renewShared(ctx context.Context, l sqllock.Lease, key string, ttl time.Duration) (sqllock.Lease, error) {
	var s, k sharedRow
	var now int64
	err := b.write(ctx, outcome.Renew, l.Key, func(ctx context.Context) error {
		s, k = sharedRow{}, sharedRow{}
		var r sharedRow
		var rk string
		return b.queryRows(ctx, outcome.Renew, b.shared.renew, []any{l.Key, l.Key, l.Token, leaseMillis(ttl), key},
			[]any{&rk, &r.token, &r.held, &r.deadline, &r.owner, &r.epoch, &now},
			func() {
				r.found = true
				if rk == l.Key {
					s = r
				} else {
					k = r
				}
			})
	})
	if err != nil {
		return sqllock.Lease{}, b.translate(err, true)
	}
	if lost := sharedLoss(l, s, k, now); lost != nil {
		return sqllock.Lease{}, lost
	}
	l.Deadline = time.UnixMilli(s.deadline)
	l.BackendTime = time.UnixMilli(now)
	return l, nil
}

// releaseShared releases shared lease l of key with one statement.
func (b *Backend) releaseShared(ctx context.Context, l sqllock.Lease, key string) error {
	var s, k sharedRow
	var now int64
	err := b.write(ctx, outcome.Release, l.Key, func(ctx context.Context) error {
		s, k = sharedRow{}, sharedRow{}
		var r sharedRow
		var rk string
		return b.queryRows(ctx, outcome.Release, b.shared.release, []any{l.Key, l.Key, l.Token, l.Owner, key},
			[]any{&rk, &r.token, &r.held, &r.deadline, &r.owner, &r.shared, &r.epoch, &now},
			func() {
				r.found = true
				if rk == l.Key {
					s = r
				} else {
					k = r
				}
			})
	})
	if err != nil {
		return b.translate(err, true)
	}
	if k.found && !k.held && k.owner == "" {
		b.signal(key) // the last reader left (or had): writers may go
	}
	b.signal(l.Key)
	st := keyState(s.found, s.token, s.held, s.deadline, now, s.owner)
	if !st.ReleasedByOwner(l) {
		if lost := st.Loss(l); lost != nil {
			return lost
		}
		return fmt.Errorf("sqllock/sqlite: Release %q: the slot is still held", l.Key)
	}
	// Released by l's owner, now or before: was the lease still valid?
	if s.deadline <= now {
		return &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostExpired}
	}
	if k.found && !k.held && k.owner == "" && k.shared == 0 && k.epoch <= l.Token {
		return nil // the key was released by its last reader
	}
	if lost := keyLoss(l, k, now); lost != nil {
		return lost
	}
	return nil
}
