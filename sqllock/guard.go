package sqllock

import (
	"context"
	"errors"
	"sync"
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

	mu sync.Mutex // guards st
	st guardState

	// Each part below has its own owner: rel its own mutex, slot the
	// Client's scheduler (under its mu), link the Client (under its mu);
	// obs is set before the Guard is shared.
	rel  releaseBook
	slot schedSlot
	link guardLink
	obs  *guardObs // for the Observer's events (observe.go); nil without one
}

// guardState is what changes while a Guard lives: its lease, its
// renewals' failures, and its end. Guarded by the Guard's mu.
type guardState struct {
	term     term
	lastErr  error // the last transient renewal error, nil after a success
	failures int   // consecutive failed scheduled renewals
	// ctx is made on first use (Context, Done): most Guards of a busy
	// client are never asked for it. cause is why the Guard ended, set
	// once: the first of a *LostError, ErrReleased, or the parent
	// context's cause; ctx, once made, is cancelled with it.
	ctx       context.Context
	cancel    context.CancelCauseFunc
	cause     error
	lost      *LostError // set once, at the first definite loss
	finishing bool       // set once, by the first Release (or the parent's end)
	lostIn    *batch     // the batch in flight when the lease was lost, if any
}

// term is the lease as of the last successful renewal, and the local
// deadline it gives: with the Guard's key, token and owner, which never
// change, it makes the Lease.
type term struct {
	deadline    time.Time // by the backend's clock
	backendTime time.Time
	value       []byte    // the acquire's; a renewal never changes it
	local       time.Time // the local deadline; never moves back
}

// extend applies a successful renewal sent at sent, whose local deadline
// is sent + life, capped at maxAt (when not zero).
func (t *term) extend(sent time.Time, life time.Duration, maxAt time.Time, l Lease) {
	nl := sent.Add(life)
	if !maxAt.IsZero() {
		nl = capAt(nl, maxAt)
	}
	if nl.After(t.local) {
		t.local = nl
	}
	// Renewals may complete out of order. The value is the acquire's,
	// whatever the backend echoes: a renewal never changes it.
	if l.Deadline.After(t.deadline) {
		t.deadline, t.backendTime = l.Deadline, l.BackendTime
	}
}

// newGuard makes the Guard of lease l, granted to an acquire request sent
// at sent, and its schedule: the first renewal one interval after sent
// (none when the max hold caps the local deadline already), its end at the
// local deadline. Nothing is shared yet: Client.hold hands it out.
func newGuard(c *Client, parent context.Context, l Lease, sent time.Time, s settings) *Guard {
	if mutantOn(mutantDeadlineFromReply) {
		sent = time.Now()
	}
	local := sent.Add(s.ttl - s.margin)
	var maxAt time.Time
	if s.maxHold > 0 {
		maxAt = sent.Add(s.maxHold)
		local = capAt(local, maxAt)
	}
	g := &Guard{c: c, s: s.timings, key: l.Key, token: l.Token, owner: l.Owner, parent: parent, maxAt: maxAt,
		st:   guardState{term: term{deadline: l.Deadline, backendTime: l.BackendTime, value: l.Value, local: local}},
		slot: schedSlot{due: sent.Add(s.interval), expAt: local, dueIdx: -1, expIdx: -1}}
	if g.capped(local) {
		g.slot.due = time.Time{} // no renewal can extend it: none is sent
	}
	if c.obs.on() {
		g.obs = &guardObs{start: sent, owner: l.Owner}
	}
	return g
}

// leaseLocked returns the lease as of the last successful renewal. Called
// with g.mu held.
func (g *Guard) leaseLocked() Lease {
	t := &g.st.term
	return Lease{Key: g.key, Token: g.token, Owner: g.owner, Deadline: t.deadline, BackendTime: t.backendTime, Value: t.value}
}

// errRenewTooLate is returned by renew when the local deadline passed while
// the renewal was in flight: the guard is (being) lost and not revived.
var errRenewTooLate = errors.New("sqllock: renewal succeeded after the local deadline")

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
	return g.st.term.local
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
	st := &g.st
	if st.ctx == nil {
		st.ctx, st.cancel = context.WithCancelCause(g.parent)
		if st.cause != nil {
			st.cancel(st.cause)
		}
	}
	return st.ctx
}

// Done is shorthand for g.Context().Done().
func (g *Guard) Done() <-chan struct{} { return g.Context().Done() }

// Err returns nil while the lease is held, else why it is not: a
// [*LostError], [ErrReleased], or the acquire context's cause.
func (g *Guard) Err() error {
	g.mu.Lock()
	cause := g.st.cause
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
	st := &g.st
	if st.cause != nil {
		return
	}
	if g.parent.Err() != nil {
		cause = context.Cause(g.parent)
	}
	st.cause = cause
	if st.cancel != nil {
		st.cancel(cause)
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
func (g *Guard) renew(ctx context.Context) (Lease, error) {
	g.mu.Lock()
	lease, local := g.leaseLocked(), g.st.term.local
	g.mu.Unlock()
	sent := time.Now()
	rctx, cancel := context.WithDeadline(ctx, attemptDeadline(sent, local, local))
	defer cancel()
	l, err := g.c.b.TryRenew(rctx, lease, g.s.ttl)
	r := renewal{sent: sent, replied: g.c.obs.now(), local: local, err: err}
	if mutantOn(mutantDeadlineFromReply) {
		sent = time.Now()
	}
	l, r.final = g.renewed(sent, l, err)
	g.c.obs.renew(g, r)
	return l, r.final
}

// renewed applies the result of a renewal by Renew sent at sent, and
// returns renew's result.
func (g *Guard) renewed(sent time.Time, l Lease, err error) (Lease, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	st := &g.st
	switch {
	case st.lost != nil:
		return Lease{}, st.lost
	case st.finishing:
		return Lease{}, ErrReleased
	case err != nil:
		if !errors.Is(err, ErrLeaseLost) {
			st.lastErr = err
		}
		return Lease{}, err
	case !time.Now().Before(st.term.local):
		// The local deadline passed while the renewal was in flight; the
		// scheduler is declaring the loss. A late success does not
		// revive the Guard.
		return Lease{}, errRenewTooLate
	}
	g.extendLocked(sent, l)
	g.c.sched.reschedule(g, nil, time.Time{}, st.term.local, false)
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
	g.st.term.extend(sent, g.s.ttl-g.s.margin, g.maxAt, l)
	g.st.lastErr = nil
}

// applyRenewal applies the outcome of a scheduled renewal sent at sent in
// batch b: a success extends the local deadline from sent and schedules the
// next renewal one interval after sent; a loss ends the Guard; a transient
// error retries with backoff (at once and on its own when alone: an error
// of this lease alone in a batch).
func (g *Guard) applyRenewal(b *batch, sent, replied time.Time, l Lease, err error, alone bool) {
	sc := g.c.sched
	r := renewal{sent: sent, replied: replied, err: err}
	g.mu.Lock()
	st := &g.st
	r.local = st.term.local
	if st.lost != nil || st.finishing {
		sc.landed(g, b)
		r.final = ErrReleased
		if st.lost != nil {
			r.final = st.lost
		}
		g.mu.Unlock()
		g.c.obs.renew(g, r)
		return
	}
	now := time.Now()
	failures, lost := 0, false
	switch {
	case err == nil && !now.Before(st.term.local):
		// The local deadline passed while the renewal was in flight: the
		// scheduler ends the Guard at it; a late success does not revive.
		r.final = errRenewTooLate
		sc.landed(g, b)
	case err == nil:
		g.extendLocked(sent, l)
		st.failures = 0
		sc.reschedule(g, b, sent.Add(g.s.interval), st.term.local, false)
	case errors.Is(err, ErrLeaseLost) && mutantOn(mutantGuardIgnoresLoss):
		r.final = err
		sc.reschedule(g, b, now.Add(g.s.interval), time.Time{}, false)
	case errors.Is(err, ErrLeaseLost):
		r.final, lost = err, true
		sc.landed(g, b)
	default:
		r.final = err
		st.lastErr = err
		st.failures++
		failures = st.failures
		next := now.Add(min(g.c.opts.Backoff(failures), g.s.interval))
		if alone || b.timedOut() {
			// Alone: an error of this lease alone in a batch. Timed out:
			// the attempt was abandoned at its bound (a call that hangs),
			// and has waited already.
			next = now
		}
		sc.reschedule(g, b, next, time.Time{}, alone)
	}
	g.mu.Unlock()
	g.c.obs.renew(g, r)
	switch {
	case failures > 0:
		g.logRenewFailure(failures, err)
	case lost:
		g.lose(err)
	}
}

// localDeadlinePassed runs on the scheduler when the local deadline came
// without a renewal confirmed by the backend, whether they failed, hung, or
// could not be sent.
func (g *Guard) localDeadlinePassed() {
	g.mu.Lock()
	last, maxHold := g.st.lastErr, g.capped(g.st.term.local)
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
	st := &g.st
	if st.lost != nil || st.finishing {
		g.mu.Unlock()
		return
	}
	st.lost = le
	// Unscheduled before the context ends: a Release that the end wakes
	// finds the batch in flight (if any) and waits for it, so that it
	// reaches the backend after the renewal.
	b, last := g.c.sched.remove(g)
	st.lostIn = b
	g.endLocked(le)
	ours := st.cause == le
	g.mu.Unlock()
	if last {
		b.abandon() // no live lease needs it any more
	}
	if g.parent.Done() != nil { // else watchParent watched nothing
		g.c.unwatchParent(g)
	}
	if ours {
		g.c.log.WarnContext(g.parent, "sqllock: lease lost", g.logAttrs("reason", le.Reason.Name(), "err", le.Err)...)
	}
	g.c.obs.lost(g, le, time.Now())
}
