package sqllock

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// Reaper is implemented by backends that can delete the rows of keys that
// nobody holds, so that a table of per-entity keys (order:81723,
// customer:42) grows with the work in progress, not with its history
// (docs/key-reaping.md). It is optional: a backend without it keeps every
// key, and `sqllock prune` says so.
//
// Reaping keeps G2 literally: after a key's row is deleted, its next grant
// still gets a token strictly greater than every token the key ever had.
// The backends keep a table-wide floor, the largest token of every row
// ever reaped, raised in the same atomic step as the delete; a key's first
// grant takes floor + 1, and on PostgreSQL an insert whose token is not
// above the floor once it is in (a reap that committed while the insert
// was on its way) fails closed.
type Reaper interface {
	// Reap deletes at most limit keys whose lease ended (released or
	// expired) at least olderThan ago by the backend's clock: a key's
	// deadline at or before now - olderThan. It never deletes a key held
	// with an unexpired lease, nor one an unfinished fenced transaction
	// holds, nor a semaphore's rows (keys containing "#permit"), and never
	// makes an acquire, renewal or release wait for it: rows that other
	// transactions have locked are skipped. It returns how many keys it
	// deleted; fewer than limit means none was left to delete (as far as
	// it could see without waiting).
	//
	// After a reap, a lease of a deleted key (an expired one: a held,
	// unexpired key is never deleted) renews and releases as expired,
	// [ErrLeaseLost] with [LostExpired].
	//
	// Errors: [ErrInvalidReap] for a negative olderThan or a limit outside
	// [1, [MaxReapLimit]], before any I/O; [ErrUnavailable] and other
	// errors are transient, and then nothing, or some batch of keys, was
	// deleted.
	Reap(ctx context.Context, olderThan time.Duration, limit int) (int, error)
}

// MaxReapLimit bounds one [Reaper.Reap] call: a reap is one short
// transaction, so that the rows it locks are locked briefly.
const MaxReapLimit = 10000

// DefaultReapLimit is the batch size of `sqllock prune`.
const DefaultReapLimit = 1000

// ErrInvalidReap is returned by [Reaper.Reap] for arguments out of range.
var ErrInvalidReap = errors.New("sqllock: invalid reap")

// ErrReapUnsupported says that a backend does not implement [Reaper].
var ErrReapUnsupported = errors.New("sqllock: this backend keeps every key (it does not reap)")

// ValidateReap reports whether olderThan and limit are valid arguments of
// [Reaper.Reap]: olderThan at least 0, limit in [1, [MaxReapLimit]]. The
// error matches [ErrInvalidReap].
func ValidateReap(olderThan time.Duration, limit int) error {
	if olderThan < 0 {
		return fmt.Errorf("%w: olderThan %v is negative", ErrInvalidReap, olderThan)
	}
	if limit < 1 || limit > MaxReapLimit {
		return fmt.Errorf("%w: limit %d outside [1, %d]", ErrInvalidReap, limit, MaxReapLimit)
	}
	return nil
}

// Reap deletes, in batches of [DefaultReapLimit], every key of b whose
// lease ended at least olderThan ago, until a batch finds fewer or ctx
// ends, and returns how many it deleted. It returns an error matching
// [ErrReapUnsupported] for a backend that does not implement [Reaper].
func Reap(ctx context.Context, b Backend, olderThan time.Duration) (int, error) {
	r, ok := b.(Reaper)
	if !ok {
		return 0, fmt.Errorf("%w (%T)", ErrReapUnsupported, b)
	}
	total := 0
	for {
		n, err := r.Reap(ctx, olderThan, DefaultReapLimit)
		total += n
		if err != nil || n < DefaultReapLimit {
			return total, err
		}
		if err := ctx.Err(); err != nil {
			return total, err
		}
	}
}
