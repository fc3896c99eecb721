package sqllock

import (
	"context"
	"sync"
	"time"
)

// releaseCtx is the context of a release: its parent bounded by a
// deadline, as context.WithDeadline makes it, but made lazily. Most
// releases end long before their bound, at a backend that never asks for a
// channel (the memory backend polls Err): for them the bound costs this
// struct and a clock read instead of a context, a timer and its closure.
// The context.WithDeadline it stands for is made on the first call that
// needs it: Done (a channel to select on), or an Err that finds the
// context ended (the parent ended, the deadline passed, or stop was
// called); from then on every method answers as that context does, so
// that Err, once non-nil, never changes, and context.Cause agrees with
// Err.
type releaseCtx struct {
	parent   context.Context
	deadline time.Time // the earlier of the parent's and the bound

	mu      sync.Mutex
	ctx     context.Context // the context.WithDeadline, once made
	cancel  context.CancelFunc
	stopped bool
}

// init bounds parent by timeout from now. c is zero and not yet shared.
func (c *releaseCtx) init(parent context.Context, timeout time.Duration) {
	d := time.Now().Add(timeout)
	if pd, ok := parent.Deadline(); ok && pd.Before(d) {
		d = pd
	}
	c.parent, c.deadline = parent, d
}

// madeLocked returns the context.WithDeadline, made now if the context has
// ended or force is set, else nil. Called with c.mu held.
func (c *releaseCtx) madeLocked(force bool) context.Context {
	if c.ctx != nil {
		return c.ctx
	}
	if !force && !c.stopped && c.parent.Err() == nil && time.Until(c.deadline) > 0 {
		return nil // live: nothing to make yet
	}
	c.ctx, c.cancel = context.WithDeadline(c.parent, c.deadline)
	if c.stopped {
		c.cancel()
	}
	return c.ctx
}

// stop ends the context, as a context.CancelFunc does; the release calls
// it when it returns.
func (c *releaseCtx) stop() {
	c.mu.Lock()
	c.stopped = true
	if c.cancel != nil {
		c.cancel()
	}
	c.mu.Unlock()
}

func (c *releaseCtx) Deadline() (time.Time, bool) { return c.deadline, true }

func (c *releaseCtx) Done() <-chan struct{} {
	c.mu.Lock()
	ctx := c.madeLocked(true)
	c.mu.Unlock()
	return ctx.Done()
}

func (c *releaseCtx) Err() error {
	c.mu.Lock()
	ctx := c.madeLocked(false)
	c.mu.Unlock()
	if ctx == nil {
		return nil
	}
	return ctx.Err()
}

// Value answers as the parent does until the context.WithDeadline is
// made: it has the parent's values. context.Cause calls Err first, which
// makes it if the context has ended, so that Cause then reads the made
// context's cause; a context derived from this one calls Done first, so
// that it hangs on the made context's cancellation, not on a goroutine.
func (c *releaseCtx) Value(key any) any {
	c.mu.Lock()
	ctx := c.ctx
	c.mu.Unlock()
	if ctx == nil {
		return c.parent.Value(key)
	}
	return ctx.Value(key)
}

func (c *releaseCtx) String() string {
	return "sqllock.releaseCtx(deadline " + c.deadline.String() + ")"
}
