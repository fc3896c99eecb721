package postgres

import (
	"context"
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// Shared locks (docs/shared-locks.md): each operation is one statement,
// queries/shared_acquire.sql, shared_renew.sql and shared_release.sql,
// from schema version 7 (migration 00007). Each locks K's row before its
// reader slot's, the one order of every statement that locks both.

// errSharedSchema is the error of a shared request on a table without
// migration 00007's columns, before anything is sent.
func errSharedSchema(table string) error {
	return fmt.Errorf("%w: table %s lacks the shared-lock columns of migration 00007 (run `sqllock migrate up`, then rebuild the Backend)",
		sqllock.ErrSchemaMissing, table)
}

// sharedKeyRow is K's row as a shared statement's snapshot saw it.
type sharedKeyRow struct {
	found, held  bool
	token, epoch int64
	deadline     time.Time
	owner        string
}

// conflictedShared is how many times a shared acquire that found its
// snapshot overtaken (another grant of the key committed while it waited
// for the key's row) is sent again before it reports a refusal to try
// again at once, as a raced exclusive acquire does.
const conflictedShared = 3

// tryAcquireShared grants a shared request with one statement
// (shared_acquire), which returns the slot's lease or K's row as its
// snapshot saw it, for the refusal.
func (b *Backend) tryAcquireShared(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	if err := req.ValidateShared(); err != nil {
		return sqllock.Lease{}, err
	}
	if err := ctx.Err(); err != nil {
		return sqllock.Lease{}, pg.NotSent(outcome.Acquire, req.Key, true, err)
	}
	st, err := b.statements(ctx, outcome.Acquire, req.Key)
	if err != nil {
		return sqllock.Lease{}, err
	}
	if !st.shared {
		return sqllock.Lease{}, errSharedSchema(b.table)
	}
	q := st.sharedAcquire
	if b.watched(req.Key) {
		q = st.sharedAcquireWait
	}
	var (
		granted, kHeld, kept, live       bool
		key, kOwner, markOwner           string
		token, kToken                    int64
		deadline, kDeadline, markDL, now time.Time
		value, kValue                    []byte
		shared                           int
	)
	for attempt := 0; ; attempt++ {
		value, kValue = nil, nil
		err = b.queryRow(ctx, q, []any{req.Key, leaseMicros(req.TTL), req.Owner, nonEmpty(req.Value)},
			&granted, &key, &token, &deadline, &value,
			&kToken, &kHeld, &kDeadline, &kOwner, &kValue, &kept, &shared, &live, &markOwner, &markDL, &now)
		if err != nil {
			return sqllock.Lease{}, b.translate(ctx, outcome.Acquire, req.Key, err)
		}
		if granted {
			return sqllock.Lease{Key: key, Token: token, Owner: req.Owner, Deadline: deadline, BackendTime: now, Value: nonEmpty(value)}, nil
		}
		exclusive := !live && ((kHeld && kDeadline.After(now)) || (!kHeld && kept && kDeadline.After(now)))
		switch {
		case exclusive:
			return sqllock.Lease{}, &sqllock.HeldError{Key: req.Key, Owner: kOwner, Token: kToken,
				Remaining: kDeadline.Sub(now), Value: nonEmpty(kValue), WaitingWriter: markOwner}
		case markOwner != "":
			he := &sqllock.HeldError{Key: req.Key, Remaining: markDL.Sub(now), WaitingWriter: markOwner}
			if live {
				he.Shared, he.Token = shared, kToken
			}
			return sqllock.Lease{}, he
		case kToken == math.MaxInt64:
			return sqllock.Lease{}, fmt.Errorf("%w: %q reached token %d", sqllock.ErrTokenExhausted, req.Key, kToken)
		case live && shared >= sqllock.MaxShared:
			return sqllock.Lease{}, &sqllock.HeldError{Key: req.Key, Token: kToken, Remaining: kDeadline.Sub(now), Shared: shared}
		}
		// Grantable in the snapshot, yet not granted: another grant (or a
		// mark) of the key committed while the statement waited for its
		// row. Its next snapshot sees it.
		if attempt+1 == conflictedShared {
			return sqllock.Lease{}, &sqllock.HeldError{Key: req.Key}
		}
		b.conflictRetries.Add(1)
	}
}

// sharedLoss is why shared lease l is not valid, by its slot's row (s)
// and its key's row (k) as the statement's snapshot saw them, or nil.
func sharedLoss(l sqllock.Lease, s sqllock.KeyState, k sharedKeyRow, now time.Time) *sqllock.LostError {
	if lost := s.Loss(l); lost != nil {
		return lost
	}
	switch {
	case k.found && k.held && k.owner == "" && k.deadline.After(now) && k.epoch <= l.Token:
		return nil
	case k.found && k.owner != "" && k.token > l.Token:
		return &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostTaken, Current: k.token}
	case k.found && k.held && k.owner == "" && !k.deadline.After(now):
		return &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostExpired}
	}
	return &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostReleased, By: k.owner}
}

// renewShared renews shared lease l of key with one statement.
func (b *Backend) renewShared(ctx context.Context, l sqllock.Lease, key string, ttl time.Duration) (sqllock.Lease, error) {
	st, err := b.statements(ctx, outcome.Renew, l.Key)
	if err != nil {
		return sqllock.Lease{}, err
	}
	if !st.shared {
		return sqllock.Lease{}, errSharedSchema(b.table)
	}
	var (
		renewed       bool
		deadline, sDL time.Time
		s             sqllock.KeyState
		k             sharedKeyRow
		now           time.Time
	)
	err = b.queryRowVia(ctx, sendOpts{pooler: true, aside: true}, st.sharedRenew, []any{l.Key, l.Token, leaseMicros(ttl), key},
		&renewed, &deadline, &s.Found, &s.Token, &s.Held, &s.Owner,
		&k.found, &k.token, &k.held, &k.deadline, &k.owner, &k.epoch, &now)
	if err != nil {
		return sqllock.Lease{}, b.translate(ctx, outcome.Renew, l.Key, err)
	}
	if !renewed {
		sDL = deadline
		s.Expired = !sDL.After(now)
		if lost := sharedLoss(l, s, k, now); lost != nil {
			return sqllock.Lease{}, lost
		}
		// Valid in the snapshot, yet a newer row refused: released (or
		// expired and ended) while the statement ran.
		return sqllock.Lease{}, &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostReleased}
	}
	l.Deadline = deadline
	l.BackendTime = now
	return l, nil
}

// releaseShared releases shared lease l of key with one statement.
func (b *Backend) releaseShared(ctx context.Context, l sqllock.Lease, key string) error {
	st, err := b.statements(ctx, outcome.Release, l.Key)
	if err != nil {
		return err
	}
	if !st.shared {
		return errSharedSchema(b.table)
	}
	var (
		released, valid, counted, last bool
		sDL, now                       time.Time
		s                              sqllock.KeyState
		k                              sharedKeyRow
		notified                       int64
	)
	err = b.queryRowVia(ctx, sendOpts{pooler: true, aside: true}, st.sharedRelease, []any{l.Key, l.Token, l.Owner, key},
		&released, &valid, &counted, &last, &s.Found, &s.Token, &s.Held, &sDL, &s.Owner,
		&k.found, &k.token, &k.held, &k.deadline, &k.owner, &k.epoch, &now, &notified)
	if err != nil {
		return b.translate(ctx, outcome.Release, l.Key, err)
	}
	s.Expired = !sDL.After(now)
	switch {
	case released && !valid:
		return &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostExpired}
	case released && counted:
		return nil // released in its key's epoch
	case released:
		// The slot was l's, but its key no longer held l's epoch.
		if lost := sharedLoss(l, sqllock.KeyState{Found: true, Token: l.Token, Held: true}, k, now); lost != nil {
			return lost
		}
		return &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostReleased}
	case s.ReleasedByOwner(l):
		return nil // released before, by l's owner
	}
	if lost := s.Loss(l); lost != nil {
		return lost
	}
	// Held with l's token in the snapshot, yet its newest row was not:
	// released (by someone else) while the statement ran.
	return &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostReleased}
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
	var plain []sqllock.RenewRequest
	var at []int
	for i, r := range reqs {
		if !isShared(r) {
			plain, at = append(plain, r), append(at, i)
			continue
		}
		key, _, _ := sqllock.ParseSharedKey(r.Lease.Key)
		l, err := b.renewShared(ctx, r.Lease, key, r.TTL)
		if err != nil && !isLost(err) && ctx.Err() != nil {
			return nil, err
		}
		out[i] = sqllock.RenewResult{Lease: l, Err: err}
	}
	if len(plain) > 0 {
		res, err := b.renewBatch(ctx, plain)
		if err != nil {
			return nil, err
		}
		for j, r := range res {
			out[at[j]] = r
		}
	}
	return out, nil
}

// isLost reports whether err is a lease's loss (not a failure to send).
func isLost(err error) bool {
	_, ok := errors.AsType[*sqllock.LostError](err)
	return ok
}
