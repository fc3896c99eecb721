package sqllock

import (
	"context"
	"fmt"
)

// AcquirePermit takes one permit of semaphore key, whose limit is n, and
// returns its Guard: at most n Guards (of every Client of the backend)
// hold a permit of key at once. A permit is an ordinary lease under its
// own key ([PermitKey]; the Guard's Key), with its own fencing token,
// strictly increasing per permit, renewed, released and lost exactly as a
// Guard from [Client.Acquire] (docs/semaphores.md).
//
// It waits as [Client.Acquire] does, by opts.Wait: with no Wait one
// attempt, which returns an error matching [ErrNotAcquired] (a
// [*PermitsHeldError] naming every holder and the soonest end) when every
// permit is held; with a positive Wait (or [WaitForever]) it waits,
// sleeping at most until the soonest holder's end and waking at once when
// any permit of key is released (when the backend is a [Watcher]).
//
// Before any I/O it refuses a limit outside [1, [MaxPermits]]
// ([ErrInvalidPermits]), a key that is itself a permit's or a limit's key
// or whose permits' keys would be too long ([ErrInvalidKey]), and a
// MinHold ([ErrMinHoldUnsupported]); a backend that does not implement
// [PermitAcquirer] gives an [*UnsupportedError] naming it. The semaphore's
// limit is stored with it by its first grant: asking for another n gives
// a [*PermitLimitError] ([ErrPermitLimit]).
func (c *Client) AcquirePermit(ctx context.Context, key string, n int, opts *AcquireOptions) (*Guard, error) {
	s, err := c.prepare(key, opts)
	if err != nil {
		return nil, err
	}
	if s.shared {
		return nil, fmt.Errorf("%w: AcquirePermit takes no Shared", ErrInvalidOption)
	}
	req := c.request(key, s)
	req.permits = n
	if err := (PermitRequest{AcquireRequest: req, Permits: n}).Validate(); err != nil {
		return nil, err
	}
	if _, ok := c.b.(PermitAcquirer); !ok {
		return nil, &UnsupportedError{Backend: c.opts.BackendName, What: "semaphores", Need: "sqllock.PermitAcquirer"}
	}
	if opts == nil || opts.Wait == 0 {
		return c.acquire(ctx, req, s, 0)
	}
	return c.acquire(ctx, req, s, opts.Wait)
}

// send sends one acquire request to the backend: a permit acquire when
// req has a limit.
func (c *Client) send(ctx context.Context, req AcquireRequest) (Lease, error) {
	if req.permits == 0 {
		return c.b.TryAcquire(ctx, req)
	}
	n := req.permits
	req.permits = 0
	return c.b.(PermitAcquirer).TryAcquirePermit(ctx, PermitRequest{AcquireRequest: req, Permits: n})
}
