package postgres

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// The answers of the single statements: from a statement's row to the
// contract's result, shared with the batch statements' rows (batch.go).

// acquireRow is what queries/acquire.sql (and acquire_batch.sql, per key)
// returns.
type acquireRow struct {
	granted, held, changed, skipped bool
	token                           int64
	deadline, now                   time.Time
	owner                           string
	value                           []byte // the holder's, on refusal
	shared                          int    // the readers' count, on refusal by readers (00007)
	waiting                         string // a live writer's mark, on refusal (00007)
}

// acquired is TryAcquire's answer to req from its statement's row r.
func acquired(req sqllock.AcquireRequest, r acquireRow) (sqllock.Lease, error) {
	switch {
	case r.granted:
		return sqllock.Lease{
			Key:         req.Key,
			Token:       r.token,
			Owner:       req.Owner,
			Deadline:    r.deadline,
			BackendTime: r.now,
			Value:       nonEmpty(req.Value),
		}, nil
	case r.changed:
		// Held in the snapshot, but the row changed (or was locked) before
		// the waiter's mark could apply: most likely it was released, without
		// a notification since it had no mark. Try again soon.
		return sqllock.Lease{}, &sqllock.HeldError{Key: req.Key}
	case r.held && r.deadline.After(r.now):
		return sqllock.Lease{}, &sqllock.HeldError{Key: req.Key, Owner: r.owner, Token: r.token, Remaining: r.deadline.Sub(r.now), Value: nonEmpty(r.value),
			Shared: r.shared, WaitingWriter: r.waiting}
	case r.token == math.MaxInt64:
		return sqllock.Lease{}, fmt.Errorf("%w: %q reached token %d", sqllock.ErrTokenExhausted, req.Key, r.token)
	default:
		// The key had no row and a concurrent first insert won, or the row
		// looked free in the statement's snapshot but a concurrent acquire
		// took it first (the UPDATE re-checked the newer row and refused).
		return sqllock.Lease{}, &sqllock.HeldError{Key: req.Key}
	}
}

// lostReason explains why lease l could not be renewed or fenced, from the
// key's row as the statement's snapshot saw it (current token 0: no row).
func lostReason(l sqllock.Lease, current int64, held bool, deadline, now time.Time) *sqllock.LostError {
	st := sqllock.KeyState{Found: current > 0, Token: current, Held: held, Expired: !deadline.After(now)}
	if lost := st.Loss(l); lost != nil {
		return lost
	}
	// Valid in the snapshot, yet the UPDATE refused the newer row: it was
	// released (or, rarely, expired and taken) while the statement ran.
	return &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostReleased}
}

// errRaced: a release found l's lease held again by its owner in a fresh
// read after its UPDATE lost a race; it has to be sent again.
var errRaced = errors.New("release raced a re-grant")

// releasedLost is Release's answer when its statement cleared nothing and
// the row (found, token, held, owner) is not l's lease held: nil for a
// lease l's owner released before, errRaced when l's token is held again
// (re-granted to l's owner by a retried acquire since the release's
// snapshot), else why l is lost.
func releasedLost(l sqllock.Lease, found bool, token int64, held bool, owner string) error {
	st := sqllock.KeyState{Found: found, Token: token, Held: held, Owner: owner}
	if st.ReleasedByOwner(l) {
		return nil // released before, by l's owner
	}
	if lost := st.Loss(l); lost != nil {
		return lost
	}
	return errRaced // held with l's token (Loss is nil only then)
}

// releaseRaced reads the row after a Release lost the race for it. The

// nonEmpty is v, or nil when v holds no byte: no value is nil everywhere.
func nonEmpty(v []byte) []byte {
	if len(v) == 0 {
		return nil
	}
	return v
}

// micros is ttl in whole microseconds, rounded up.
func micros(ttl time.Duration) int64 {
	return int64((ttl + time.Microsecond - 1) / time.Microsecond)
}

// leaseMicros is what a statement adds to its "now" for a lease of ttl:
// ttl in whole microseconds, rounded up, and one more. PostgreSQL's clock
// (statement_timestamp(), clock_timestamp()) reads whole microseconds,
// truncated, so the statement's now may be up to 1µs before the instant it
// was read; with the extra microsecond a deadline
// is always later than (that instant + ttl), and so later than the holder's
// send time + ttl, whatever margin the client uses.
func leaseMicros(ttl time.Duration) int64 { return micros(ttl) + 1 }

// holdMicros is what a grant adds to its "now" for a minimum hold: as
// leaseMicros, so that grant + hold is never earlier than asked; 0 for none.
func holdMicros(hold time.Duration) int64 {
	if hold == 0 {
		return 0
	}
	return leaseMicros(hold)
}
