// Package memory is an in-process [sqllock.Backend]: the full lease semantics
// for the goroutines of one process, with no database. It is what examples
// and the deterministic simulation run on, and a fine lock for a single
// process that wants fencing tokens and leases.
//
// Its clock is [time.Now] (or the function given to [NewWithClock]), so it
// runs inside a testing/synctest bubble with fake time. It blocks only
// briefly on a mutex, never on I/O.
package memory

import (
	"bytes"
	"context"
	"math"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/ashlock/ashlock/internal/wait"
	"github.com/ashlock/ashlock/sqllock"
)

// Backend keeps leases in a map. It is safe for concurrent use. The zero
// value is not usable; call [New].
type Backend struct {
	now func() time.Time

	mu      sync.Mutex // guards keys, floor and batches
	keys    map[string]*entry
	batches uint64 // batch renewals so far
	// floor is the largest token of every key ever reaped: a key's first
	// grant takes floor + 1, so a reaped key never gets an old token back.
	floor   int64
	signals wait.Signals
}

type entry struct {
	token    int64
	held     bool
	deadline time.Time
	owner    string
	batch    uint64 // the last batch renewal that renewed it (see TryRenewBatch)
	value    []byte // the latest grant's, never changed in place
	// holdUntil is the latest grant's time + its MinHold (zero for none):
	// a release by the holder before it keeps the key until then.
	holdUntil time.Time

	// Shared locks, on a key's entry (shared.go).
	shared       int
	epoch        int64
	slots        int
	markOwner    string
	markDeadline time.Time
}

var (
	_ sqllock.Backend      = (*Backend)(nil)
	_ sqllock.Watcher      = (*Backend)(nil)
	_ sqllock.BatchRenewer = (*Backend)(nil)
	_ sqllock.Reaper       = (*Backend)(nil)
)

// New returns an empty Backend whose clock is [time.Now].
func New() *Backend { return NewWithClock(time.Now) }

// NewWithClock returns an empty Backend whose "database clock" is now. Tests
// use it to step the backend's clock apart from the clients' clocks.
func NewWithClock(now func() time.Time) *Backend {
	return &Backend{
		now:  now,
		keys: make(map[string]*entry),
	}
}

// TryAcquire implements [sqllock.Backend].
func (b *Backend) TryAcquire(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	if req.Shared {
		return b.tryAcquireShared(ctx, req)
	}
	if err := req.Validate(); err != nil {
		return sqllock.Lease{}, err
	}
	if err := ctx.Err(); err != nil {
		return sqllock.Lease{}, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	e := b.keys[req.Key]
	switch {
	case e == nil:
		e = &entry{token: b.floor}
		b.keys[req.Key] = e
	case e.held && now.Before(e.deadline) && e.owner == req.Owner:
		// A retry of this very acquire: same grant, extended.
		e.deadline = later(now.Add(req.TTL), e.holdUntil)
		return b.lease(req.Key, e, now), nil
	case e.held && now.Before(e.deadline),
		!e.held && now.Before(e.holdUntil) && now.Before(e.deadline): // released inside its min hold
		he := &sqllock.HeldError{
			Key: req.Key, Owner: e.owner, Token: e.token, Remaining: e.deadline.Sub(now), Value: bytes.Clone(e.value),
		}
		if liveShared(e, now) {
			he.Shared = e.shared
		}
		if req.Mark && (!marked(e, now) || e.markOwner == req.Owner) {
			// A waiting writer: new shared grants are refused from now on.
			e.markOwner, e.markDeadline = req.Owner, now.Add(req.TTL)
		}
		he.WaitingWriter = e.waitingWriter(now)
		return sqllock.Lease{}, he
	}
	if e.token == math.MaxInt64 {
		return sqllock.Lease{}, sqllock.ErrTokenExhausted
	}
	e.token++
	e.held = true
	if e.markOwner == req.Owner {
		e.markOwner, e.markDeadline = "", time.Time{} // the writer holds: its mark ends
	}
	e.holdUntil = time.Time{}
	if req.MinHold > 0 {
		e.holdUntil = now.Add(req.MinHold)
	}
	e.deadline = later(now.Add(req.TTL), e.holdUntil)
	e.owner = req.Owner
	e.value = nil
	if len(req.Value) > 0 {
		e.value = bytes.Clone(req.Value)
	}
	return b.lease(req.Key, e, now), nil
}

func (b *Backend) lease(key string, e *entry, now time.Time) sqllock.Lease {
	return sqllock.Lease{Key: key, Token: e.token, Owner: e.owner, Deadline: e.deadline, BackendTime: now, Value: bytes.Clone(e.value)}
}

// TryRenew implements [sqllock.Backend].
func (b *Backend) TryRenew(ctx context.Context, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
	if err := sqllock.ValidateLease(l); err != nil {
		return sqllock.Lease{}, err
	}
	if err := sqllock.ValidateTTL(ttl); err != nil {
		return sqllock.Lease{}, err
	}
	if err := ctx.Err(); err != nil {
		return sqllock.Lease{}, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	if key, _, ok := sqllock.ParseSharedKey(l.Key); ok {
		s, lost := b.renewShared(l, key, ttl, now, false)
		if lost != nil {
			return sqllock.Lease{}, lost
		}
		return b.lease(l.Key, s, now), nil
	}
	e := b.keys[l.Key]
	if lost := state(e, now).Loss(l); lost != nil {
		return sqllock.Lease{}, lost
	}
	e.deadline = later(now.Add(ttl), e.holdUntil)
	return b.lease(l.Key, e, now), nil
}

// later returns the later of a and b.
func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}

// TryRenewBatch implements [sqllock.BatchRenewer]: every element under
// one lock, at one instant of the backend's clock.
func (b *Backend) TryRenewBatch(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
	if err := sqllock.ValidateRenewBatch(reqs); err != nil {
		return nil, err
	}
	if len(reqs) == 0 {
		return nil, nil
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	out := make([]sqllock.RenewResult, len(reqs))
	b.mu.Lock()
	defer b.mu.Unlock()
	b.batches++
	now := b.now()
	for i, r := range reqs {
		if key, _, ok := sqllock.ParseSharedKey(r.Lease.Key); ok {
			s, lost := b.renewShared(r.Lease, key, r.TTL, now, true)
			if lost != nil {
				out[i].Err = lost
				continue
			}
			s.batch = b.batches
			continue
		}
		e := b.keys[r.Lease.Key]
		if lost := state(e, now).Loss(r.Lease); lost != nil {
			out[i].Err = lost
			continue
		}
		// A lease given twice is renewed once, by the longer TTL.
		d := later(now.Add(r.TTL), e.holdUntil)
		if e.batch != b.batches || d.After(e.deadline) {
			e.deadline = d
		}
		e.batch = b.batches
	}
	for i, r := range reqs {
		if out[i].Err == nil {
			out[i].Lease = b.lease(r.Lease.Key, b.keys[r.Lease.Key], now)
		}
	}
	return out, nil
}

// state is e (nil: no such key) at now, as sqllock.KeyState.
func state(e *entry, now time.Time) sqllock.KeyState {
	if e == nil {
		return sqllock.KeyState{}
	}
	return sqllock.KeyState{Found: true, Token: e.token, Held: e.held, Expired: !now.Before(e.deadline), Owner: e.owner}
}

// Release implements [sqllock.Backend].
func (b *Backend) Release(ctx context.Context, l sqllock.Lease) error {
	if err := sqllock.ValidateLease(l); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.releaseLocked(l, b.now())
}

// releaseLocked is Release at now, with b.mu held.
func (b *Backend) releaseLocked(l sqllock.Lease, now time.Time) error {
	e := b.keys[l.Key]
	if key, _, ok := sqllock.ParseSharedKey(l.Key); ok {
		return b.releaseShared(l, key, now)
	}
	st := state(e, now)
	if st.ReleasedByOwner(l) {
		return nil // released twice by its owner
	}
	lost := st.Loss(l)
	if e != nil && e.token == l.Token && e.held {
		e.held = false
		if e.owner == l.Owner && now.Before(e.holdUntil) {
			// Released inside its min hold: the key stays taken, by this
			// owner and token, until then.
			e.deadline = e.holdUntil
		} else {
			e.holdUntil = time.Time{} // a forced release ends the hold
			b.signal(l.Key)
		}
		e.owner = l.Owner
	}
	if lost != nil {
		return lost
	}
	return nil
}

// List implements [sqllock.Backend].
func (b *Backend) List(ctx context.Context, prefix string) ([]sqllock.LockInfo, error) {
	if err := sqllock.ValidatePrefix(prefix); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	now := b.now()
	var out []sqllock.LockInfo
	for k, e := range b.keys {
		if !strings.HasPrefix(k, prefix) {
			continue
		}
		info := sqllock.LockInfo{Key: k, Token: e.token, Owner: e.owner, Deadline: e.deadline, Value: bytes.Clone(e.value)}
		if (e.held || now.Before(e.holdUntil)) && now.Before(e.deadline) {
			info.Held, info.Remaining = true, e.deadline.Sub(now)
		}
		if liveShared(e, now) {
			info.Shared = e.shared
		}
		info.WaitingWriter = e.waitingWriter(now)
		out = append(out, info)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out, nil
}

// Watch implements [sqllock.Watcher]: Release signals the key's watchers.
func (b *Backend) Watch(key string) (<-chan struct{}, func()) { return b.signals.Watch(key) }

// Expire makes key's lease expire now (its deadline becomes the backend's
// now), keeping token and held as they are, and wakes its watchers. It is the
// conformance suite's and the simulation's way to skip a TTL.
func (b *Backend) Expire(key string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if e := b.keys[key]; e != nil {
		e.deadline = b.now()
		b.signal(key)
	}
}

// SetToken makes key exist, released, with the given current token. Tests
// use it to reach the end of the token space.
func (b *Backend) SetToken(key string, token int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.keys[key] = &entry{token: token, deadline: b.now()}
}
