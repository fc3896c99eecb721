package sqllock

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// Release ends the lease. It is safe to call more than once, and from
// several goroutines; every call returns the first call's result, except a
// later call whose context ends while the first is still at the backend
// (it returns its context's error). If the lease had been lost before, it
// returns the [*LostError], so the caller learns that its critical section
// may have overlapped another holder's; if the backend found the lease no
// longer valid, it returns that [ErrLeaseLost].
//
// Release is bounded by ctx and by Options.ReleaseTimeout; if ctx has
// already ended, the release still runs, bounded by ReleaseTimeout alone.
// A renewal of the lease in flight (a batch it shares with other leases)
// is not cancelled: Release waits for it for at most half of that bound
// before it releases, so that the release is the lease's last operation at
// the backend, and for the rest of the bound after. A renewal stuck in a
// backend that does not answer ends on its own, at its deadline (a renewal
// applied after the release finds nothing to renew).
func (g *Guard) Release(ctx context.Context) error {
	rctx := g.rel.context()
	g.c.initReleaseContext(rctx, ctx)
	defer rctx.stop()
	return g.release(rctx)
}

// parentEnded runs when the acquire context ended before Release: the
// lease is released on the caller's behalf, bounded by ReleaseTimeout.
func (g *Guard) parentEnded() {
	g.mu.Lock()
	if g.st.finishing || g.st.lost != nil {
		g.mu.Unlock()
		return
	}
	g.st.finishing = true
	g.endLocked(context.Cause(g.parent))
	g.mu.Unlock()
	rctx := g.c.releaseContext(context.Background())
	defer rctx.stop()
	b, last := g.c.sched.remove(g)
	g.awaitBatch(rctx, b, true, last)
	g.rel.finish(g.releaseBackend(rctx))
	g.awaitBatch(rctx, b, false, false)
}

// releaseUnshared releases the lease of a Guard that was never handed
// out (its Client closed meanwhile).
func (g *Guard) releaseUnshared(cause error) {
	g.st.finishing = true
	g.st.cause = cause
	rctx := g.c.releaseContext(g.parent)
	defer rctx.stop()
	g.rel.finish(g.releaseBackend(rctx))
}

// release is Release with its bound already set: ctx is used as it is.
func (g *Guard) release(ctx context.Context) error {
	b, last, ok := g.startRelease()
	if !ok {
		return g.awaitRelease(ctx)
	}
	g.awaitBatch(ctx, b, true, last)
	err := g.releaseBackend(ctx)
	g.rel.finish(err)
	g.awaitBatch(ctx, b, false, false)
	return err
}

// awaitRelease is Release's answer when another call is releasing the
// Guard: its result, or an error when ctx ends first.
func (g *Guard) awaitRelease(ctx context.Context) error {
	if err, done := g.rel.wait(ctx); done {
		return err
	}
	return fmt.Errorf("sqllock: release of %q (token %d) still in progress: %w", g.key, g.token, ctx.Err())
}

// startRelease makes the Guard finishing, ends it and takes it off the
// schedule: the first half of release, before the backend is called. It
// returns the batch that may carry the lease's renewal (and whether the
// lease was its last live one), and ok false, doing nothing, when the
// Guard is already finishing (another call releases it).
func (g *Guard) startRelease() (b *batch, last, ok bool) {
	g.mu.Lock()
	st := &g.st
	if st.finishing {
		g.mu.Unlock()
		return nil, false, false
	}
	st.finishing = true
	// The Guard stops counting as held before anything is sent: once the
	// backend applies the release another client may take the key, and the
	// release may take longer than the local deadline. From here on no
	// renewal result is applied (applyRenewal checks finishing), so the
	// lease read by releaseBackend no longer changes.
	g.endLocked(ErrReleased)
	// The batch in flight when the lease was lost, if it was: lose sets
	// it before the Guard is finishing, never after.
	lostIn := st.lostIn
	g.mu.Unlock()
	b, last = g.c.sched.remove(g)
	if b == nil {
		b = lostIn
	}
	if g.parent.Done() != nil { // else watchParent watched nothing
		g.c.unwatchParent(g)
	}
	return b, last, true
}

// releaseBook is a Guard's release bookkeeping: the context of its first
// Release call, kept here so that the common release allocates nothing
// for it, and the release's result, which every later Release call
// returns. mu guards taken, done, err and ch (first belongs to the Release
// that took it); it is never held together with the
// Guard's mu.
type releaseBook struct {
	mu    sync.Mutex
	first releaseCtx // the first Release call's context
	taken bool       // first is taken: later calls make their own
	done  bool       // the release has completed; err is its result
	err   error
	ch    chan struct{} // made by a Release that waits for another; closed when done
}

// context returns a release context for a Release call to set up: the
// Guard's own for the first call, a new one for each later call.
func (r *releaseBook) context() *releaseCtx {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.taken {
		return new(releaseCtx)
	}
	r.taken = true
	return &r.first
}

// finish records the release's result and wakes the Releases waiting for it.
func (r *releaseBook) finish(err error) {
	r.mu.Lock()
	r.err, r.done = err, true
	if r.ch != nil {
		close(r.ch)
	}
	r.mu.Unlock()
}

// wait waits until the release has completed and returns its result, or
// until ctx ends (done false).
func (r *releaseBook) wait(ctx context.Context) (err error, done bool) {
	r.mu.Lock()
	if r.done {
		err := r.err
		r.mu.Unlock()
		return err, true
	}
	if r.ch == nil {
		r.ch = make(chan struct{})
	}
	ch := r.ch
	r.mu.Unlock()
	select {
	case <-ch:
	case <-ctx.Done():
		return nil, false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.err, true
}

// awaitBatch waits for the batch carrying the lease's renewal to land: for
// at most half of the time ctx has left (half), or until ctx ends. If the
// batch is still in flight then and last is set (the lease was the last
// live one in it), it cancels the batch (no lease needs its result, and a
// backend that has not answered by now is not answering) and waits for it
// to return for at most half of what is left.
func (g *Guard) awaitBatch(ctx context.Context, b *batch, half, last bool) {
	if b == nil {
		return
	}
	select {
	case <-b.done:
		return
	default:
	}
	wait := ctx
	if deadline, ok := ctx.Deadline(); ok && half {
		var cancel context.CancelFunc
		wait, cancel = context.WithTimeout(ctx, time.Until(deadline)/2)
		defer cancel()
	}
	select {
	case <-b.done:
		return
	case <-wait.Done():
	}
	if last {
		b.abandon()
		// A backend that heeds the cancellation returns at once: let it,
		// so that the release still comes after the renewal at the
		// backend; one that does not gets half of what is left.
		g.awaitBatch(ctx, b, true, false)
	}
}

// releaseBackend releases the lease at the backend (unless a newer token or
// a release already ended it), within ctx, reports it, and forgets the
// Guard. It runs once, after the Guard has ended.
func (g *Guard) releaseBackend(ctx context.Context) error {
	defer g.c.forget(g)
	start := g.c.obs.now()
	err := g.releaseLease(ctx)
	g.c.obs.release(g, start, err)
	return err
}

// releaseAttempts is how many times a release is sent when its answer is
// transient.
const releaseAttempts = 3

// releaseLease is releaseBackend's call to the backend, retried a few
// times on a transient error.
func (g *Guard) releaseLease(ctx context.Context) (err error) {
	lease, lost, send := g.releaseInput()
	if !send {
		return lost
	}
	for attempt := 1; ; attempt++ {
		err = g.c.b.Release(ctx, lease)
		if err == nil || !releaseRetryable(err) || attempt == releaseAttempts {
			break
		}
		sleep(ctx, g.c.opts.Backoff(attempt))
		if ctx.Err() != nil {
			break
		}
	}
	return g.releaseOutcome(lease, lost, err)
}

// releaseInput is the lease to release and the loss the Guard saw before,
// if it did; send is false when that loss says nothing is left to release
// (a newer token, or a release, ended the lease).
func (g *Guard) releaseInput() (lease Lease, lost *LostError, send bool) {
	g.mu.Lock()
	lease, lost = g.leaseLocked(), g.st.lost
	g.mu.Unlock()
	return lease, lost, lost == nil || (lost.Reason != LostTaken && lost.Reason != LostReleased)
}

// releaseOutcome is the release's result from the backend's answer err:
// the loss seen before, if any, else err, logged when not nil.
func (g *Guard) releaseOutcome(lease Lease, lost *LostError, err error) error {
	if lost != nil {
		return lost
	}
	if err != nil {
		g.c.logReleaseFailure(g.parent, lease, err)
	}
	return err
}

// releaseRetryable reports whether a release that failed with err is
// sent again (releaseLease's rule).
func releaseRetryable(err error) bool {
	return errors.Is(err, ErrUnavailable) || errors.Is(err, ErrIndeterminate)
}

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
