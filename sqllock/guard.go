package sqllock

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Guard is one held lease. The Client's renewal scheduler renews it every
// renew interval, together with the other leases due at about the same
// time, and cancels [Guard.Context] the moment the lease is lost or its
// local deadline passes without a successful renewal. A Guard is safe for
// concurrent use.
//
// The local deadline is (monotonic time just before the last successful
// acquire or renew request was sent) + TTL - margin. Because the lease
// began at the backend no earlier than the request was sent, the local
// deadline is never later than the backend's deadline, whatever the network
// delay, as long as the clocks run at nearly the same rate.
type Guard struct {
	c      *Client
	s      timings
	key    string
	token  int64
	owner  string
	parent context.Context // the acquire context
	// maxAt is the acquire's send time + AcquireOptions.MaxHold, which the
	// local deadline never passes; zero without a max hold.
	maxAt time.Time
	// watch ends the Guard when parent ends (nil when parent never ends,
	// or once it has ended, been released or lost); guarded by the
	// Client's mu.
	watch *parentWatch

	mu sync.Mutex // guards the fields below
	// The lease as of the last successful renewal: leaseLocked builds it
	// from these and key, token and owner, which never change.
	deadline    time.Time // by the backend's clock
	backendTime time.Time
	value       []byte    // the acquire's; a renewal never changes it
	local       time.Time // the local deadline; never moves back
	// ctx is made on first use (Context, Done): most Guards of a busy
	// client are never asked for it. cause is why the Guard ended, set
	// once: the first of a *LostError, ErrReleased, or the parent
	// context's cause; ctx, once made, is cancelled with it.
	ctx       context.Context
	cancel    context.CancelCauseFunc
	cause     error
	lastErr   error         // the last transient renewal error, nil after a success
	attempt   int           // consecutive failed scheduled renewals
	lost      *LostError    // set once, at the first definite loss
	finishing bool          // set once, by the first Release (or the parent's end)
	finished  bool          // the release has completed; finishErr is its result
	finishCh  chan struct{} // made by a Release that waits for another; closed when finished
	finishErr error
	lostIn    *batch // the batch in flight when the lease was lost, if any

	// Scheduling, guarded by the scheduler's mu.
	due      time.Time // the next renewal
	expAt    time.Time // the local deadline, as the scheduler's heap has it
	dueIdx   int32     // index in the scheduler's due heap, -1 if not there
	expIdx   int32     // index in the scheduler's deadline heap, -1 if not there
	inFlight *batch    // the batch carrying this lease's renewal, if any
	alone    bool      // renew it next on its own (TryRenew), not in a batch

	// The Client's list of Guards, guarded by the Client's mu.
	prev, next *Guard

	obs *guardObs // for the Observer's events (observe.go); nil without one

	// rctx is the context of the Guard's first Release call, kept here
	// so that the common release allocates nothing for it; rctxTaken
	// says that call has taken it (later calls make their own).
	rctx      releaseCtx
	rctxTaken atomic.Bool
}

// leaseLocked returns the lease as of the last successful renewal. Called
// with g.mu held.
func (g *Guard) leaseLocked() Lease {
	return Lease{Key: g.key, Token: g.token, Owner: g.owner, Deadline: g.deadline, BackendTime: g.backendTime, Value: g.value}
}

// errRenewTooLate is returned by renew when the local deadline passed while
// the renewal was in flight: the guard is (being) lost and not revived.
var errRenewTooLate = errors.New("sqllock: renewal succeeded after the local deadline")

func (c *Client) newGuard(parent context.Context, l Lease, sent time.Time, s settings) (*Guard, error) {
	if mutantOn(mutantDeadlineFromReply) {
		sent = time.Now()
	}
	local := sent.Add(s.ttl - s.margin)
	var maxAt time.Time
	if s.maxHold > 0 {
		maxAt = sent.Add(s.maxHold)
		local = capAt(local, maxAt)
	}
	// time.Until reads only the monotonic clock: half the cost of
	// time.Now().Before, which reads the wall clock too.
	if time.Until(local) <= 0 {
		// The reply came too late to use the lease safely.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(parent), c.opts.ReleaseTimeout)
		defer cancel()
		c.releaseQuietly(rctx, l)
		return nil, &LostError{Key: l.Key, Token: l.Token, Reason: LostExpired,
			Err: errors.New("the acquire reply arrived after the local deadline")}
	}
	g := &Guard{c: c, s: s.timings, key: l.Key, token: l.Token, owner: l.Owner, parent: parent,
		maxAt: maxAt, deadline: l.Deadline, backendTime: l.BackendTime, value: l.Value, local: local, dueIdx: -1, expIdx: -1}
	g.observeStart(sent)

	c.mu.Lock()
	closed := c.closed
	if !closed {
		c.link(g)
	}
	c.mu.Unlock()
	if closed {
		g.finishing = true
		g.cause = ErrClosed
		rctx := c.releaseContext(parent)
		defer rctx.stop()
		g.finishErr = g.releaseBackend(rctx)
		g.finished = true
		return nil, ErrClosed
	}
	due := sent.Add(s.interval)
	if g.capped(local) {
		due = time.Time{} // no renewal can extend it: none is sent
	}
	c.sched.add(g, due, local)
	c.watchParent(g)
	return g, nil
}

// Key returns the locked key.
func (g *Guard) Key() string { return g.key }

// Token returns the lease's fencing token: strictly greater than every token
// granted for this key before. Pass it to the protected resource, which
// should remember the highest token it has seen and refuse writes carrying a
// lower one; that keeps a stale holder (paused, partitioned, or slow to
// notice its loss) from overwriting a newer holder's work.
func (g *Guard) Token() int64 { return g.token }

// Lease returns the lease as of the last successful renewal.
func (g *Guard) Lease() Lease {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.leaseLocked()
}

// LocalDeadline returns the local deadline: the monotonic instant at which
// the Guard will consider its lease lost unless a renewal succeeds first.
func (g *Guard) LocalDeadline() time.Time {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.local
}

// MaxHoldDeadline returns the monotonic instant at which the Guard ends
// for its [AcquireOptions.MaxHold] (the acquire's send time + MaxHold),
// or the zero time without one. The local deadline never passes it.
func (g *Guard) MaxHoldDeadline() time.Time { return g.maxAt }

// Context returns a context that is cancelled when the lease is lost (cause:
// a [*LostError] matching [ErrLeaseLost]), released (cause [ErrReleased]), or
// when the context passed to acquire ends. Read the reason with
// [context.Cause].
func (g *Guard) Context() context.Context {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.ctx == nil {
		g.ctx, g.cancel = context.WithCancelCause(g.parent)
		if g.cause != nil {
			g.cancel(g.cause)
		}
	}
	return g.ctx
}

// Done is shorthand for g.Context().Done().
func (g *Guard) Done() <-chan struct{} { return g.Context().Done() }

// Err returns nil while the lease is held, else why it is not: a
// [*LostError], [ErrReleased], or the acquire context's cause.
func (g *Guard) Err() error {
	g.mu.Lock()
	cause := g.cause
	g.mu.Unlock()
	if cause != nil {
		return cause
	}
	if g.parent.Err() != nil {
		return context.Cause(g.parent)
	}
	return nil
}

// endLocked records why the Guard ended, unless it already had, and
// cancels its context. The parent's end, if it came first, is the cause.
// Called with g.mu held.
func (g *Guard) endLocked(cause error) {
	if g.cause != nil {
		return
	}
	if g.parent.Err() != nil {
		cause = context.Cause(g.parent)
	}
	g.cause = cause
	if g.cancel != nil {
		g.cancel(cause)
	}
}

// Renew renews the lease now, in addition to the scheduler's renewals, and
// returns the renewed lease. A definite loss ends the Guard; a transient
// error is returned and left to the scheduler to retry.
func (g *Guard) Renew(ctx context.Context) (Lease, error) {
	if err := g.Err(); err != nil {
		return Lease{}, err
	}
	l, err := g.renew(ctx)
	if errors.Is(err, ErrLeaseLost) {
		g.lose(err)
	}
	if err != nil {
		if cause := g.Err(); cause != nil {
			return Lease{}, cause
		}
		return Lease{}, err
	}
	return l, nil
}

// renew sends one renewal, bounded as a scheduled attempt is (half of what
// the lease has left, see attemptDeadline), and applies its
// result unless the Guard was lost or released meanwhile.
func (g *Guard) renew(ctx context.Context) (_ Lease, final error) {
	g.mu.Lock()
	lease, local := g.leaseLocked(), g.local
	g.mu.Unlock()
	sent := time.Now()
	rctx, cancel := context.WithDeadline(ctx, attemptDeadline(sent, local, local))
	defer cancel()
	l, err := g.c.b.TryRenew(rctx, lease, g.s.ttl)
	if g.c.opts.Observer != nil {
		defer g.observeRenew(sent, time.Now(), local, err, &final)
	}
	if mutantOn(mutantDeadlineFromReply) {
		sent = time.Now()
	}

	g.mu.Lock()
	defer g.mu.Unlock()
	switch {
	case g.lost != nil:
		return Lease{}, g.lost
	case g.finishing:
		return Lease{}, ErrReleased
	case err != nil:
		if !errors.Is(err, ErrLeaseLost) {
			g.lastErr = err
		}
		return Lease{}, err
	case !time.Now().Before(g.local):
		// The local deadline passed while the renewal was in flight; the
		// scheduler is declaring the loss. A late success does not
		// revive the Guard.
		return Lease{}, errRenewTooLate
	}
	g.extendLocked(sent, l)
	g.c.sched.reschedule(g, nil, time.Time{}, g.local, false)
	return l, nil
}

// capAt returns local, or maxAt if that is earlier.
func capAt(local, maxAt time.Time) time.Time {
	if maxAt.Before(local) {
		return maxAt
	}
	return local
}

// capped reports whether the local deadline local has reached the Guard's
// max hold: no renewal can extend it, and the Guard ends there.
func (g *Guard) capped(local time.Time) bool {
	return !g.maxAt.IsZero() && !local.Before(g.maxAt)
}

// extendLocked applies a successful renewal sent at sent. Called with g.mu
// held, before the local deadline.
func (g *Guard) extendLocked(sent time.Time, l Lease) {
	nl := sent.Add(g.s.ttl - g.s.margin)
	if !g.maxAt.IsZero() {
		nl = capAt(nl, g.maxAt)
	}
	if nl.After(g.local) {
		g.local = nl
	}
	// Renewals may complete out of order. The value is the acquire's,
	// whatever the backend echoes: a renewal never changes it.
	if l.Deadline.After(g.deadline) {
		g.deadline, g.backendTime = l.Deadline, l.BackendTime
	}
	g.lastErr = nil
}

// applyRenewal applies the outcome of a scheduled renewal sent at sent in
// batch b: a success extends the local deadline from sent and schedules the
// next renewal one interval after sent; a loss ends the Guard; a transient
// error retries with backoff (at once and on its own when alone: an error
// of this lease alone in a batch).
func (g *Guard) applyRenewal(b *batch, sent, replied time.Time, l Lease, err error, alone bool) {
	sc := g.c.sched
	g.mu.Lock()
	local := g.local
	if g.lost != nil || g.finishing {
		sc.landed(g, b)
		var final error = ErrReleased
		if g.lost != nil {
			final = g.lost
		}
		g.mu.Unlock()
		if g.c.opts.Observer != nil {
			g.observeRenew(sent, replied, local, err, &final)
		}
		return
	}
	now := time.Now()
	var final error // the renewal's result for the Guard, as renew returns it
	attempt, lost := 0, false
	switch {
	case err == nil && !now.Before(g.local):
		// The local deadline passed while the renewal was in flight: the
		// scheduler ends the Guard at it; a late success does not revive.
		final = errRenewTooLate
		sc.landed(g, b)
	case err == nil:
		g.extendLocked(sent, l)
		g.attempt = 0
		sc.reschedule(g, b, sent.Add(g.s.interval), g.local, false)
	case errors.Is(err, ErrLeaseLost) && mutantOn(mutantGuardIgnoresLoss):
		final = err
		sc.reschedule(g, b, now.Add(g.s.interval), time.Time{}, false)
	case errors.Is(err, ErrLeaseLost):
		final, lost = err, true
		sc.landed(g, b)
	default:
		final = err
		g.lastErr = err
		g.attempt++
		attempt = g.attempt
		next := now.Add(min(g.c.opts.Backoff(attempt), g.s.interval))
		if alone || b.timedOut() {
			// Alone: an error of this lease alone in a batch. Timed out:
			// the attempt was abandoned at its bound (a call that hangs),
			// and has waited already.
			next = now
		}
		sc.reschedule(g, b, next, time.Time{}, alone)
	}
	g.mu.Unlock()
	if g.c.opts.Observer != nil {
		g.observeRenew(sent, replied, local, err, &final)
	}
	switch {
	case attempt > 0:
		g.logRenewFailure(attempt, err)
	case lost:
		g.lose(err)
	}
}

// localDeadlinePassed runs on the scheduler when the local deadline came
// without a renewal confirmed by the backend, whether they failed, hung, or
// could not be sent.
func (g *Guard) localDeadlinePassed() {
	g.mu.Lock()
	last, maxHold := g.lastErr, g.capped(g.local)
	g.mu.Unlock()
	if maxHold {
		// The deadline was the max hold: renewals could not have moved it.
		g.lose(&LostError{Key: g.key, Token: g.token, Reason: LostMaxHold})
		return
	}
	g.lose(&LostError{Key: g.key, Token: g.token, Reason: LostUnreachable, Err: last})
}

// lose records the first definite loss, ends the Guard and unschedules it.
// After a loss the lease is not released by the client: it may still be
// valid at the backend for up to the margin, and that margin belongs to the
// holder that is stopping.
func (g *Guard) lose(err error) {
	var le *LostError
	if !errors.As(err, &le) {
		le = &LostError{Key: g.key, Token: g.token, Reason: LostUnreachable, Err: err}
	}
	g.mu.Lock()
	if g.lost != nil || g.finishing {
		g.mu.Unlock()
		return
	}
	g.lost = le
	// Unscheduled before the context ends: a Release that the end wakes
	// finds the batch in flight (if any) and waits for it, so that it
	// reaches the backend after the renewal.
	b, last := g.c.sched.remove(g)
	g.lostIn = b
	g.endLocked(le)
	ours := g.cause == le
	g.mu.Unlock()
	if last {
		b.abandon() // no live lease needs it any more
	}
	if g.parent.Done() != nil { // else watchParent watched nothing
		g.c.unwatchParent(g)
	}
	g.noteLoss(le, ours)
}

// parentEnded runs when the acquire context ended before Release: the
// lease is released on the caller's behalf, bounded by ReleaseTimeout.
func (g *Guard) parentEnded() {
	g.mu.Lock()
	if g.finishing || g.lost != nil {
		g.mu.Unlock()
		return
	}
	g.finishing = true
	g.endLocked(context.Cause(g.parent))
	g.mu.Unlock()
	rctx := g.c.releaseContext(context.Background())
	defer rctx.stop()
	b, last := g.c.sched.remove(g)
	g.awaitBatch(rctx, b, true, last)
	g.finish(g.releaseBackend(rctx))
	g.awaitBatch(rctx, b, false, false)
}

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
	var rctx *releaseCtx
	if g.rctxTaken.CompareAndSwap(false, true) {
		rctx = &g.rctx
	} else {
		rctx = new(releaseCtx)
	}
	g.c.initReleaseContext(rctx, ctx)
	defer rctx.stop()
	return g.release(rctx)
}

// release is Release with its bound already set: ctx is used as it is.
func (g *Guard) release(ctx context.Context) error {
	g.mu.Lock()
	if g.finishing {
		if g.finished {
			err := g.finishErr
			g.mu.Unlock()
			return err
		}
		if g.finishCh == nil {
			g.finishCh = make(chan struct{})
		}
		ch := g.finishCh
		g.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return fmt.Errorf("sqllock: release of %q (token %d) still in progress: %w", g.key, g.token, ctx.Err())
		}
		g.mu.Lock()
		err := g.finishErr
		g.mu.Unlock()
		return err
	}
	g.finishing = true
	// The Guard stops counting as held before anything is sent: once the
	// backend applies the release another client may take the key, and the
	// release may take longer than the local deadline. From here on no
	// renewal result is applied (applyRenewal checks finishing), so the
	// lease read by releaseBackend no longer changes.
	g.endLocked(ErrReleased)
	// The batch in flight when the lease was lost, if it was: lose sets
	// it before the Guard is finishing, never after.
	lostIn := g.lostIn
	g.mu.Unlock()
	b, last := g.c.sched.remove(g)
	if b == nil {
		b = lostIn
	}
	if g.parent.Done() != nil { // else watchParent watched nothing
		g.c.unwatchParent(g)
	}
	g.awaitBatch(ctx, b, true, last)
	err := g.releaseBackend(ctx)
	g.finish(err)
	g.awaitBatch(ctx, b, false, false)
	return err
}

// finish records the release's result and wakes the Releases waiting for it.
func (g *Guard) finish(err error) {
	g.mu.Lock()
	g.finishErr = err
	g.finished = true
	if g.finishCh != nil {
		close(g.finishCh)
	}
	g.mu.Unlock()
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
// a release already ended it), within ctx, and forgets the Guard. It runs
// once, after the Guard has ended.
func (g *Guard) releaseBackend(ctx context.Context) (err error) {
	defer g.c.forget(g)
	if g.c.opts.Observer != nil {
		defer g.observeRelease(time.Now(), &err)
	}
	g.mu.Lock()
	lease, lost := g.leaseLocked(), g.lost
	g.mu.Unlock()
	if lost != nil && (lost.Reason == LostTaken || lost.Reason == LostReleased) {
		return lost
	}
	for attempt := 1; ; attempt++ {
		err = g.c.b.Release(ctx, lease)
		if err == nil || (!errors.Is(err, ErrUnavailable) && !errors.Is(err, ErrIndeterminate)) || attempt == 3 {
			break
		}
		sleep(ctx, g.c.opts.Backoff(attempt))
		if ctx.Err() != nil {
			break
		}
	}
	if lost != nil {
		return lost
	}
	if err != nil {
		g.c.logReleaseFailure(g.parent, lease, err)
	}
	return err
}
