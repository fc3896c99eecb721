package memory

import (
	"bytes"
	"context"
	"math"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// Shared grants (sqllock's shared locks): a key K held shared is K's entry
// held with an empty owner, its token the latest reader's and its deadline
// the latest of its readers', plus one entry per reader under
// sqllock.SharedKey(K, i). The fields below live on K's entry.
//
//	shared: the reader slots held (released or not expired) with a token
//	        at or above epoch: the readers not yet released
//	epoch:  the token of the first shared grant of the current run of
//	        shared holders
//	slots:  the reader slots K has (1..slots)
//	mark:   a waiting writer's owner and the mark's deadline

// liveShared reports whether k is held shared at now.
func liveShared(k *entry, now time.Time) bool {
	return k != nil && k.held && k.owner == "" && now.Before(k.deadline)
}

// marked reports whether k carries a writer's mark at now.
func marked(k *entry, now time.Time) bool {
	return k != nil && k.markOwner != "" && now.Before(k.markDeadline)
}

func (k *entry) waitingWriter(now time.Time) string {
	if marked(k, now) {
		return k.markOwner
	}
	return ""
}

// tryAcquireShared grants a shared request under the rules of sqllock's
// shared locks.
func (b *Backend) tryAcquireShared(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	if err := req.ValidateShared(); err != nil {
		return sqllock.Lease{}, err
	}
	if err := ctx.Err(); err != nil {
		return sqllock.Lease{}, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	k := b.keys[req.Key]
	if k == nil {
		// A key without an entry (new, or reaped) starts at the floor,
		// as an exclusive grant's does.
		k = &entry{token: b.floor}
		b.keys[req.Key] = k
	}
	live := liveShared(k, now)
	if live {
		// A retry of this very acquire: same grant, extended.
		for i := 1; i <= k.slots; i++ {
			sk := sqllock.SharedKey(req.Key, i)
			s := b.keys[sk]
			if s.held && now.Before(s.deadline) && s.owner == req.Owner && s.token >= k.epoch {
				s.deadline = now.Add(req.TTL)
				k.deadline = later(k.deadline, s.deadline)
				return b.lease(sk, s, now), nil
			}
		}
	}
	switch {
	case !live && k.held && now.Before(k.deadline),
		!live && !k.held && now.Before(k.holdUntil) && now.Before(k.deadline):
		// Held exclusive (or released inside its min hold).
		return sqllock.Lease{}, &sqllock.HeldError{
			Key: req.Key, Owner: k.owner, Token: k.token, Remaining: k.deadline.Sub(now),
			Value: bytes.Clone(k.value), WaitingWriter: k.waitingWriter(now),
		}
	case marked(k, now):
		he := &sqllock.HeldError{Key: req.Key, Remaining: k.markDeadline.Sub(now), WaitingWriter: k.markOwner}
		if live {
			he.Shared, he.Token = k.shared, k.token
		}
		return sqllock.Lease{}, he
	}
	// A free slot: released, expired, or of an earlier epoch (every slot
	// is, when this grant starts an epoch).
	var slot *entry
	slotKey := ""
	for i := 1; i <= k.slots && slot == nil; i++ {
		sk := sqllock.SharedKey(req.Key, i)
		s := b.keys[sk]
		if !live || !s.held || !now.Before(s.deadline) || s.token < k.epoch {
			slot, slotKey = s, sk
		}
	}
	if slot == nil {
		if k.slots == sqllock.MaxShared {
			return sqllock.Lease{}, &sqllock.HeldError{Key: req.Key, Token: k.token, Remaining: k.deadline.Sub(now), Shared: k.shared}
		}
		k.slots++
		slotKey = sqllock.SharedKey(req.Key, k.slots)
		slot = &entry{deadline: now}
		b.keys[slotKey] = slot
	}
	top := max(k.token, slot.token)
	if top == math.MaxInt64 {
		return sqllock.Lease{}, sqllock.ErrTokenExhausted
	}
	counted := live && slot.held && slot.token >= k.epoch // an expired reader of this epoch, not released
	slot.token = top
	grant(slot, req, now)
	k.token = slot.token
	if !live {
		k.epoch, k.shared = slot.token, 1
		k.held, k.owner, k.value, k.holdUntil = true, "", nil, time.Time{}
		k.deadline = slot.deadline
	} else {
		if !counted {
			k.shared++
		}
		k.deadline = later(k.deadline, slot.deadline)
	}
	return b.lease(slotKey, slot, now), nil
}

// sharedLoss returns why shared lease l (of key k, slot s) is not valid at
// now, or nil.
func sharedLoss(l sqllock.Lease, k, s *entry, now time.Time) *sqllock.LostError {
	if lost := state(s, now).Loss(l); lost != nil {
		return lost
	}
	switch {
	case liveShared(k, now) && k.epoch <= l.Token:
		return nil
	case k.owner != "" && k.token > l.Token:
		return &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostTaken, Current: k.token}
	case k.held && k.owner == "" && !now.Before(k.deadline):
		return &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostExpired}
	}
	// K's row was released under the readers (a forced release), perhaps
	// held shared again since, by a later epoch.
	return &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostReleased, By: k.owner}
}

// renewShared renews shared lease l by ttl at now, moving its key's
// deadline along. Called with b.mu held.
// In a batch (batch set) a lease given twice is renewed once, by the
// longer TTL.
func (b *Backend) renewShared(l sqllock.Lease, key string, ttl time.Duration, now time.Time, batch bool) (*entry, *sqllock.LostError) {
	k, s := b.keys[key], b.keys[l.Key]
	if k == nil {
		return nil, state(nil, now).Loss(l)
	}
	if lost := sharedLoss(l, k, s, now); lost != nil {
		return nil, lost
	}
	d := now.Add(ttl)
	if !batch || s.batch != b.batches || d.After(s.deadline) {
		s.deadline = d
	}
	k.deadline = later(k.deadline, s.deadline)
	return s, nil
}

// releaseShared releases shared lease l of key. Called with b.mu held.
func (b *Backend) releaseShared(l sqllock.Lease, key string, now time.Time) error {
	k, s := b.keys[key], b.keys[l.Key]
	st := state(s, now)
	if st.ReleasedByOwner(l) {
		return nil
	}
	if k == nil || s == nil {
		return st.Loss(l)
	}
	lost := sharedLoss(l, k, s, now)
	if s.token == l.Token && s.held {
		s.held = false
		s.owner = l.Owner
		if k.held && k.owner == "" && l.Token >= k.epoch {
			if k.shared--; k.shared <= 0 {
				// The last reader of the epoch: K is free at once.
				k.shared = 0
				k.held = false
				b.signal(key)
			}
		}
		b.signals.Signal(l.Key)
	}
	if lost != nil {
		return lost
	}
	return nil
}
