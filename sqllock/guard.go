package sqllock

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// Guard is one held lease and its watchdog. The watchdog renews the lease
// every renew interval and cancels [Guard.Context] the moment the lease is
// lost or its local deadline passes without a successful renewal. A Guard is
// safe for concurrent use.
//
// The local deadline is (monotonic time just before the last successful
// acquire or renew request was sent) + TTL - margin. Because the lease
// began at the backend no earlier than the request was sent, the local
// deadline is never later than the backend's deadline, whatever the network
// delay, as long as the clocks run at nearly the same rate.
type Guard struct {
	c     *Client
	s     settings
	key   string
	token int64
	ctx   context.Context
	// cancel ends ctx; the first cause wins: a *LostError, ErrReleased, or
	// the parent context's cause.
	cancel context.CancelCauseFunc

	// wdCtx stops the watchdog and aborts a renewal in flight.
	wdCtx    context.Context
	wdCancel context.CancelFunc
	done     chan struct{} // closed when the watchdog has returned
	finished chan struct{} // closed when the release has completed

	mu        sync.Mutex // guards the fields below
	lease     Lease
	local     time.Time   // the local deadline; never moves back
	expiry    *time.Timer // fires at local; Stop+Reset under mu
	lastErr   error       // the last transient renewal error, nil after a success
	lost      *LostError  // set once, at the first definite loss
	finishing bool        // set once, by the first Release (or the watchdog)
	finishErr error       // the result of the release, valid after finished

	obs *guardObs // for the Observer's events (observe.go); nil without one
}

// errRenewTooLate is returned by renew when the local deadline passed while
// the renewal was in flight: the guard is (being) lost and not revived.
var errRenewTooLate = errors.New("sqllock: renewal succeeded after the local deadline")

func (c *Client) newGuard(parent context.Context, l Lease, sent time.Time, s settings) (*Guard, error) {
	if mutantOn(mutantDeadlineFromReply) {
		sent = time.Now()
	}
	local := sent.Add(s.ttl - s.margin)
	if !time.Now().Before(local) {
		// The reply came too late to use the lease safely.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(parent), c.opts.ReleaseTimeout)
		defer cancel()
		c.releaseQuietly(rctx, l)
		return nil, &LostError{Key: l.Key, Token: l.Token, Reason: LostExpired,
			Err: errors.New("the acquire reply arrived after the local deadline")}
	}
	g := &Guard{c: c, s: s, key: l.Key, token: l.Token, lease: l, local: local, done: make(chan struct{}), finished: make(chan struct{})}
	g.ctx, g.cancel = context.WithCancelCause(parent)
	g.wdCtx, g.wdCancel = context.WithCancel(context.Background())
	g.observeStart(sent)
	g.mu.Lock()
	g.expiry = time.AfterFunc(time.Until(local), g.localDeadlinePassed)
	g.mu.Unlock()

	c.mu.Lock()
	closed := c.closed
	if !closed {
		c.guards[g] = struct{}{}
	}
	c.mu.Unlock()
	go g.watchdog(sent)
	if closed {
		_ = g.Release(parent)
		return nil, ErrClosed
	}
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
	return g.lease
}

// LocalDeadline returns the local deadline: the monotonic instant at which
// the Guard will consider its lease lost unless a renewal succeeds first.
func (g *Guard) LocalDeadline() time.Time {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.local
}

// Context returns a context that is cancelled when the lease is lost (cause:
// a [*LostError] matching [ErrLeaseLost]), released (cause [ErrReleased]), or
// when the context passed to acquire ends. Read the reason with
// [context.Cause].
func (g *Guard) Context() context.Context { return g.ctx }

// Done is shorthand for g.Context().Done().
func (g *Guard) Done() <-chan struct{} { return g.ctx.Done() }

// Err returns nil while the lease is held, else why it is not: a
// [*LostError], [ErrReleased], or the acquire context's cause.
func (g *Guard) Err() error {
	if g.ctx.Err() == nil {
		return nil
	}
	return context.Cause(g.ctx)
}

// Renew renews the lease now, in addition to the watchdog's schedule, and
// returns the renewed lease. A definite loss ends the Guard; a transient
// error is returned and left to the watchdog to retry.
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

// renew sends one renewal, bounded by the local deadline, and applies its
// result unless the Guard was lost or released meanwhile.
func (g *Guard) renew(ctx context.Context) (_ Lease, final error) {
	g.mu.Lock()
	lease, local := g.lease, g.local
	g.mu.Unlock()
	rctx, cancel := context.WithDeadline(ctx, local)
	defer cancel()
	sent := time.Now()
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
	case !g.expiry.Stop():
		// The local deadline passed while the renewal was in flight; the
		// timer's callback is declaring the loss. A late success does not
		// revive the Guard.
		return Lease{}, errRenewTooLate
	}
	l.Value = g.lease.Value // a renewal never changes it, whatever the backend echoes
	if nl := sent.Add(g.s.ttl - g.s.margin); nl.After(g.local) {
		g.local = nl
	}
	if l.Deadline.After(g.lease.Deadline) {
		g.lease = l // concurrent renewals may complete out of order
	}
	g.lastErr = nil
	g.expiry.Reset(time.Until(g.local))
	return l, nil
}

// localDeadlinePassed runs on the expiry timer's goroutine: no renewal was
// confirmed by the backend in time, whether they failed, hung, or could not
// be sent.
func (g *Guard) localDeadlinePassed() {
	g.mu.Lock()
	last := g.lastErr
	g.mu.Unlock()
	g.lose(&LostError{Key: g.key, Token: g.token, Reason: LostUnreachable, Err: last})
}

// lose records the first definite loss and cancels the Guard's context.
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
	g.expiry.Stop()
	g.mu.Unlock()
	g.cancel(le)
	g.noteLoss(le)
}

// watchdog renews the lease every interval, counted from the send time of
// the last successful renewal, and retries transient failures with backoff
// until the local deadline. It returns when the Guard is released or lost,
// or when the acquire context ends (then it releases the lease). After a
// loss it does not release: the lease may still be valid at the backend for
// up to the margin, and that margin belongs to the holder that is stopping.
func (g *Guard) watchdog(sent time.Time) {
	defer close(g.done)
	t := time.NewTimer(time.Until(sent.Add(g.s.interval)))
	defer t.Stop()
	for attempt := 0; ; {
		select {
		case <-g.wdCtx.Done():
			return
		case <-g.ctx.Done():
			g.mu.Lock()
			lost := g.lost != nil
			g.mu.Unlock()
			if !lost {
				g.parentEnded()
			}
			return
		case <-t.C:
		}
		sent := time.Now()
		_, err := g.renew(g.wdCtx)
		switch {
		case err == nil:
			attempt = 0
			t.Reset(time.Until(sent.Add(g.s.interval)))
		case errors.Is(err, ErrLeaseLost) && mutantOn(mutantGuardIgnoresLoss):
			t.Reset(g.s.interval)
		case errors.Is(err, ErrLeaseLost):
			g.lose(err)
		case errors.Is(err, errRenewTooLate), errors.Is(err, ErrReleased):
			// The timer callback or Release owns what happens next.
			t.Reset(g.s.interval)
		default:
			attempt++
			g.logRenewFailure(attempt, err)
			t.Reset(min(g.c.opts.Backoff(attempt), g.s.interval))
		}
	}
}

// parentEnded runs on the watchdog when the acquire context ended before
// Release: the lease is released on the caller's behalf, bounded by
// ReleaseTimeout.
func (g *Guard) parentEnded() {
	g.mu.Lock()
	first := !g.finishing
	g.finishing = true
	g.mu.Unlock()
	if !first {
		return
	}
	ctx, cancel := g.c.releaseContext(context.Background())
	defer cancel()
	g.finishErr = g.releaseBackend(ctx)
	close(g.finished)
}

// Release ends the lease and stops the watchdog. It is safe to call more
// than once, and from several goroutines; every call returns the first
// call's result, except a later call whose context ends while the first is
// still at the backend (it returns its context's error). If the lease had
// been lost before, it returns the [*LostError], so the caller learns that
// its critical section may have overlapped another holder's; if the backend
// found the lease no longer valid, it returns that [ErrLeaseLost].
//
// Release is bounded by ctx and by Options.ReleaseTimeout; if ctx has
// already ended, the release still runs, bounded by ReleaseTimeout alone.
// It cancels a renewal in flight and waits for the watchdog to return for
// at most half of that bound before it releases, and for the rest of the
// bound after: a renewal stuck in a backend that ignores cancellation ends
// on its own, later (a renewal applied after the release finds nothing to
// renew).
func (g *Guard) Release(ctx context.Context) error {
	ctx, cancel := g.c.releaseContext(ctx)
	defer cancel()
	return g.release(ctx)
}

// release is Release with its bound already set: ctx is used as it is.
func (g *Guard) release(ctx context.Context) error {
	g.mu.Lock()
	first := !g.finishing
	g.finishing = true
	g.expiry.Stop()
	g.mu.Unlock()
	// The Guard stops counting as held before anything is sent: once the
	// backend applies the release another client may take the key, and the
	// release may take longer than the local deadline. From here on no
	// renewal result is applied (renew checks finishing), so the lease
	// read by releaseBackend no longer changes.
	g.cancel(ErrReleased)
	g.wdCancel()
	if first {
		// The renewal in flight, if any, was just cancelled: give the
		// watchdog up to half of the bound to return, so that the release
		// is the lease's last operation at the backend (and the order of
		// the two never depends on scheduling), but keep the other half
		// for the release itself when a backend ignores cancellation.
		g.awaitWatchdog(ctx)
		g.finishErr = g.releaseBackend(ctx)
		close(g.finished)
	} else {
		select {
		case <-g.finished:
		case <-ctx.Done():
			return fmt.Errorf("sqllock: release of %q (token %d) still in progress: %w", g.key, g.token, ctx.Err())
		}
	}
	select {
	case <-g.done:
	case <-ctx.Done():
	}
	return g.finishErr
}

// awaitWatchdog waits for the watchdog to return, for at most half of the
// time ctx has left.
func (g *Guard) awaitWatchdog(ctx context.Context) {
	wait := ctx
	if deadline, ok := ctx.Deadline(); ok {
		var cancel context.CancelFunc
		wait, cancel = context.WithTimeout(ctx, time.Until(deadline)/2)
		defer cancel()
	}
	select {
	case <-g.done:
	case <-wait.Done():
	}
}

// releaseBackend releases the lease at the backend (unless a newer token or
// a release already ended it), within ctx, and forgets the Guard. It runs
// once, after the Guard's context has ended.
func (g *Guard) releaseBackend(ctx context.Context) (err error) {
	defer g.c.forget(g)
	if g.c.opts.Observer != nil {
		defer g.observeRelease(time.Now(), &err)
	}
	g.mu.Lock()
	lease, lost := g.lease, g.lost
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
		g.c.logReleaseFailure(g.ctx, lease, err)
	}
	return err
}
