package lockbench

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// ErrStole is the failure of an Attempt, or of a peer's attempt on a hot
// key, that was granted a key another holder holds.
var ErrStole = errors.New("acquired a key that another holder holds")

// Pair is the uncontended workload's operation on a Backend: TryAcquire
// of key() for ttl under owner(), then Release of the lease. A key held by
// another is busy, not a failure.
func Pair(b sqllock.Backend, key func() string, ttl time.Duration, owner func() string) Op {
	return func(ctx context.Context) (bool, error) {
		l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key(), TTL: ttl, Owner: owner()})
		if errors.Is(err, sqllock.ErrNotAcquired) {
			return false, nil
		}
		if err != nil {
			return false, err
		}
		return true, b.Release(ctx, l)
	}
}

// ClientPair is Pair through a Client: TryAcquire of key() with the
// Client's defaults, then Release of the Guard.
func ClientPair(c *sqllock.Client, key func() string) Op {
	return func(ctx context.Context) (bool, error) {
		g, err := c.TryAcquire(ctx, key(), nil)
		if errors.Is(err, sqllock.ErrNotAcquired) {
			return false, nil
		}
		if err != nil {
			return false, err
		}
		return true, g.Release(ctx)
	}
}

// Attempt is the hot workload's operation: TryAcquire of key, which
// another lease holds for the whole run, so that every attempt is refused
// (busy): the cost of polling a busy key. An attempt that is granted
// fails with ErrStole, after releasing what it got.
func Attempt(b sqllock.Backend, key string, ttl time.Duration, owner func() string) Op {
	return func(ctx context.Context) (bool, error) {
		l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: ttl, Owner: owner()})
		switch {
		case errors.Is(err, sqllock.ErrNotAcquired):
			return false, nil
		case err != nil:
			return false, err
		}
		_ = b.Release(ctx, l)
		return true, fmt.Errorf("%w: %q", ErrStole, key)
	}
}

// Owner returns the same owner every time: a worker whose operations
// never overlap.
func Owner(name string) func() string { return func() string { return name } }
