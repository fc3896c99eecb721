package sqllock

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"
)

// Observer receives what a [Client] does, as typed events: one optional
// func per kind, called synchronously on the goroutine that did the work
// (the caller of an acquire or Release, the Client's renewal scheduler, for
// a batch one event per lease, or the local-deadline timer). A nil func skips its kind; a nil *Observer, the
// default, costs nothing: no event is built and nothing is allocated.
//
// The funcs must be safe for concurrent use and must not block: a slow
// Renew func delays the next renewal. Events carry the key and the lease's
// owner; the observer decides what to keep (keys and owners are unbounded,
// so a metric should not use them as attributes, while a span or a log
// record may). Package otelsqllock turns events into OpenTelemetry metrics
// and spans.
//
// The ctx of an acquire event is the context passed to the acquire, and
// so is that of a Guard's events (renewal, release, loss, start and end):
// it carries the acquire's values (a trace span, say), as [Guard.Context]
// does, which is derived from it and is made only when asked for (the
// Guard's end is in the event, not in the context).
type Observer struct {
	// AcquireAttempt: one acquire request answered by the backend (or
	// failed), from TryAcquire, Acquire (each attempt) or Do.
	AcquireAttempt func(ctx context.Context, e AcquireAttemptEvent)
	// Acquire: a TryAcquire or Acquire call has ended: its total time
	// (for Acquire, the wait), its attempts and its outcome. Calls refused
	// before any I/O (invalid input, a closed Client) are not reported.
	Acquire func(ctx context.Context, e AcquireEvent)
	// Renew: one renewal answered by the backend (or failed), from the
	// renewal scheduler (one event per lease of a batch, all with the
	// batch's send time and duration) or [Guard.Renew].
	Renew func(ctx context.Context, e RenewEvent)
	// Release: a Guard's release has ended (Release, Do, Close, or the
	// release after the acquire's context ended). Each Guard releases once.
	Release func(ctx context.Context, e ReleaseEvent)
	// Lost: the Guard's lease was lost, found by a renewal, at the local
	// deadline, or by the release (a forced release or an expiry since the
	// last renewal). At most once per Guard.
	Lost func(ctx context.Context, e LostEvent)
	// GuardStart: a Guard was handed out; GuardEnd: it stopped holding the
	// lease (released, lost, or its acquire context ended). Exactly one
	// GuardEnd follows each GuardStart, so the two count the leases held.
	GuardStart func(ctx context.Context, e GuardEvent)
	GuardEnd   func(ctx context.Context, e GuardEvent)
}

// Outcome classifies how an operation ended, in a few stable words fit for
// a metric attribute ([Outcome.String]).
type Outcome uint8

// The outcomes. Each event's doc says which it can have.
const (
	OutcomeGranted  Outcome = iota + 1 // an acquire took the key
	OutcomeHeld                        // the key is held by another (ErrNotAcquired)
	OutcomeRenewed                     // a renewal extended the lease
	OutcomeReleased                    // released by its holder
	OutcomeLost                        // the lease was lost (ErrLeaseLost)
	// OutcomeLate: a renewal succeeded at the backend after the local
	// deadline had passed; the Guard is lost all the same.
	OutcomeLate
	OutcomeCanceled      // the caller's context (or a Release) ended it
	OutcomeTimeout       // a deadline ended it: AcquireOptions.Wait, a context deadline, or the local deadline for a renewal
	OutcomeIndeterminate // the reply was lost (ErrIndeterminate)
	OutcomeUnavailable   // a transient backend failure (ErrUnavailable)
	OutcomeError         // any other error
)

var outcomeNames = [...]string{
	OutcomeGranted:       "granted",
	OutcomeHeld:          "held",
	OutcomeRenewed:       "renewed",
	OutcomeReleased:      "released",
	OutcomeLost:          "lost",
	OutcomeLate:          "late",
	OutcomeCanceled:      "canceled",
	OutcomeTimeout:       "timeout",
	OutcomeIndeterminate: "indeterminate",
	OutcomeUnavailable:   "unavailable",
	OutcomeError:         "error",
}

// String returns the outcome as one lower-case word: granted, held,
// renewed, released, lost, late, canceled, timeout, indeterminate,
// unavailable, error.
func (o Outcome) String() string {
	if int(o) < len(outcomeNames) && outcomeNames[o] != "" {
		return outcomeNames[o]
	}
	return "unknown"
}

// outcomeOf classifies err; ok is the outcome of a nil error.
func outcomeOf(err error, ok Outcome) Outcome {
	switch {
	case err == nil:
		return ok
	case errors.Is(err, errRenewTooLate):
		return OutcomeLate
	case errors.Is(err, ErrLeaseLost):
		return OutcomeLost
	case errors.Is(err, ErrIndeterminate):
		return OutcomeIndeterminate
	case errors.Is(err, ErrUnavailable):
		return OutcomeUnavailable
	case errors.Is(err, context.DeadlineExceeded):
		return OutcomeTimeout
	case errors.Is(err, context.Canceled), errors.Is(err, ErrReleased):
		return OutcomeCanceled
	case errors.Is(err, ErrNotAcquired):
		return OutcomeHeld
	}
	return OutcomeError
}

// AcquireAttemptEvent is one acquire request.
type AcquireAttemptEvent struct {
	Key     string
	Owner   string // the lease owner this call uses (unique per call)
	Backend string // Options.BackendName
	// Token is the granted token, or the holder's when held and the
	// backend told it; else 0.
	Token int64
	// Outcome: granted, held, indeterminate, unavailable, canceled,
	// timeout or error.
	Outcome  Outcome
	Start    time.Time     // just before the request was sent
	Duration time.Duration // until the reply (or the error)
	// Settle is set for a repeat of an indeterminate attempt, made to learn
	// whether it was applied (see [Client.TryAcquire]).
	Settle bool
	Err    error // nil when granted
}

// AcquireEvent is the end of a TryAcquire or Acquire call (Do calls
// Acquire).
type AcquireEvent struct {
	Key     string
	Owner   string
	Backend string
	Token   int64 // the granted token, else 0
	// Wait is set for an Acquire given a positive AcquireOptions.Wait,
	// which waits; TryAcquire, and Acquire without a Wait, make one attempt.
	Wait bool
	// Attempts is the number of acquire requests the call made, not
	// counting the repeats that settle an indeterminate one.
	Attempts int
	// Outcome: granted, held (TryAcquire), timeout (AcquireOptions.Wait or
	// the context's deadline ended the wait), canceled, lost (granted too
	// late to use: the reply came after the local deadline),
	// indeterminate, unavailable or error.
	Outcome  Outcome
	Start    time.Time     // when the call began
	Duration time.Duration // the whole call: for Acquire, the time waited
	Err      error
}

// RenewEvent is one renewal.
type RenewEvent struct {
	Key     string
	Owner   string
	Backend string
	Token   int64
	// Outcome: renewed, late, lost, unavailable, indeterminate, timeout
	// (no reply before the local deadline), canceled (the Guard was
	// released meanwhile) or error.
	Outcome  Outcome
	Start    time.Time     // just before the request was sent
	Duration time.Duration // the round trip
	// Slack is how much time the local deadline had left when the reply
	// arrived: the local deadline in force when the renewal was sent,
	// minus the time of the reply. It shrinks as renewals slow down and is
	// negative for a reply after the local deadline.
	Slack time.Duration
	Err   error // the backend's error; nil when renewed or late
}

// ReleaseEvent is the release of a Guard's lease.
type ReleaseEvent struct {
	Key     string
	Owner   string
	Backend string
	Token   int64
	// Outcome: released, lost (the lease had ended before: the release
	// returned ErrLeaseLost), or the backend's failure: unavailable,
	// indeterminate, timeout, canceled, error (the lease then ends at its
	// deadline).
	Outcome  Outcome
	Start    time.Time     // when the release began
	Duration time.Duration // the release, retries included (nothing is sent for a lease known taken or released by another)
	// Held is how long the lease was held: from the acquire request's send
	// time until the Guard stopped holding it (the release began, or the
	// lease was lost before).
	Held time.Duration
	Err  error
}

// LostEvent is the loss of a Guard's lease.
type LostEvent struct {
	Key     string
	Owner   string
	Backend string
	Token   int64
	Reason  LostReason // [LostReason.Name] is its one-word name
	// Held is the time from the acquire request's send time to the loss.
	Held time.Duration
	Err  *LostError
}

// GuardEvent is a Guard's start or end.
type GuardEvent struct {
	Key     string
	Owner   string
	Backend string
	Token   int64
	Start   time.Time // the acquire request's send time
	// The fields below are set for GuardEnd only.

	// Outcome: released (by Release, Do or Close), lost, or canceled (the
	// acquire's context ended and the lease was released on its behalf).
	Outcome Outcome
	// Held is the time from Start until the Guard stopped holding the lease.
	Held time.Duration
	// Err is why the Guard ended: the [*LostError] of a loss, else
	// [Guard.Err] ([ErrReleased] or the acquire context's cause).
	Err error
}

// backendName is the default of Options.BackendName: the package name of
// b's type ("postgres" for a *postgres.Backend).
func backendName(b Backend) string {
	t := strings.TrimLeft(fmt.Sprintf("%T", b), "*[]")
	if i := strings.LastIndexByte(t, '.'); i >= 0 {
		t = t[:i]
	}
	if i := strings.LastIndexByte(t, '/'); i >= 0 {
		t = t[i+1:]
	}
	return t
}

// observer reports a Client's events to its Observer. The zero observer
// (a Client without an Observer) reports nothing and builds no event.
// Each method is called once the operation it reports has ended and takes
// its results, as a tracer's End does; a Guard's events go to the acquire
// context, g.parent.
type observer struct {
	o       *Observer
	backend string // Options.BackendName
}

// on reports whether there is an Observer.
func (ob observer) on() bool { return ob.o != nil }

// now returns the time now, for an event's Start or Duration, or the zero
// time without an Observer (which reads no clock).
func (ob observer) now() time.Time {
	if ob.o == nil {
		return time.Time{}
	}
	return time.Now()
}

// acquireAttempt reports the acquire request req sent at sent (settle: a
// repeat that settles an indeterminate one) and its result.
func (ob observer) acquireAttempt(ctx context.Context, req AcquireRequest, settle bool, sent time.Time, l Lease, err error) {
	if ob.o == nil || ob.o.AcquireAttempt == nil {
		return
	}
	e := AcquireAttemptEvent{
		Key: req.Key, Owner: req.Owner, Backend: ob.backend, Token: l.Token,
		Outcome: outcomeOf(err, OutcomeGranted), Start: sent, Duration: time.Since(sent),
		Settle: settle, Err: err,
	}
	if he, ok := errors.AsType[*HeldError](err); ok {
		e.Token = he.Token
	}
	ob.o.AcquireAttempt(ctx, e)
}

// acquire reports the end of a TryAcquire or Acquire call (wait: one that
// waits) for req that began at start, made attempts requests and returned
// g and err.
func (ob observer) acquire(ctx context.Context, req AcquireRequest, wait bool, start time.Time, attempts int, g *Guard, err error) {
	if ob.o == nil || ob.o.Acquire == nil {
		return
	}
	e := AcquireEvent{
		Key: req.Key, Owner: req.Owner, Backend: ob.backend, Wait: wait, Attempts: attempts,
		Outcome: outcomeOf(err, OutcomeGranted), Start: start, Duration: time.Since(start), Err: err,
	}
	if g != nil {
		e.Token = g.token
	}
	ob.o.Acquire(ctx, e)
}

// guardObs is a Guard's state for its events, allocated (by newGuard) only
// when the Client has an Observer: a Guard without one stays as small as
// before.
type guardObs struct {
	// Set before the Guard is shared, then read-only.
	start time.Time // the acquire request's send time
	owner string    // the lease's owner

	mu    sync.Mutex    // guards ended and held
	ended bool          // the Guard stopped holding its lease (GuardEnd is reported once)
	held  time.Duration // how long it held it; set with ended
}

// heldFor returns how long the Guard held its lease (after markEnded).
func (o *guardObs) heldFor() time.Duration {
	o.mu.Lock()
	defer o.mu.Unlock()
	return o.held
}

// markEnded marks the Guard ended at at, once: it returns false if it had
// already ended (or o is nil: no Observer). Held is then readable.
func (o *guardObs) markEnded(at time.Time) bool {
	if o == nil {
		return false
	}
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.ended {
		return false
	}
	o.ended, o.held = true, at.Sub(o.start)
	return true
}

func (ob observer) guardEvent(g *Guard) GuardEvent {
	return GuardEvent{Key: g.key, Owner: g.obs.owner, Backend: ob.backend, Token: g.token, Start: g.obs.start}
}

// guardStart reports the new Guard g, before it is shared.
func (ob observer) guardStart(g *Guard) {
	if ob.o != nil && ob.o.GuardStart != nil {
		ob.o.GuardStart(g.parent, ob.guardEvent(g))
	}
}

// guardEnd reports GuardEnd, after markEnded.
func (ob observer) guardEnd(g *Guard, outcome Outcome, err error) {
	if ob.o.GuardEnd != nil {
		e := ob.guardEvent(g)
		e.Outcome, e.Held, e.Err = outcome, g.obs.heldFor(), err
		ob.o.GuardEnd(g.parent, e)
	}
}

// renewal is one renewal's data for its event: sent at sent and answered
// at replied with the backend's error err, while local was the local
// deadline; final is the renewal's result for the Guard (renew's).
type renewal struct {
	sent, replied, local time.Time
	err, final           error
}

// renew reports the renewal r of g's lease.
func (ob observer) renew(g *Guard, r renewal) {
	if ob.o == nil || ob.o.Renew == nil {
		return
	}
	outcome := outcomeOf(r.err, OutcomeRenewed)
	if r.err == nil && (errors.Is(r.final, errRenewTooLate) || errors.Is(r.final, ErrLeaseLost)) {
		// Renewed at the backend, but the local deadline had passed: the
		// Guard is (being) lost.
		outcome = OutcomeLate
	}
	ob.o.Renew(g.parent, RenewEvent{
		Key: g.key, Owner: g.obs.owner, Backend: ob.backend, Token: g.token,
		Outcome: outcome, Start: r.sent, Duration: r.replied.Sub(r.sent), Slack: r.local.Sub(r.replied), Err: r.err,
	})
}

// lost reports the loss le of g's lease, found at at, unless the Guard had
// ended before: Lost, then GuardEnd.
func (ob observer) lost(g *Guard, le *LostError, at time.Time) {
	if !g.obs.markEnded(at) {
		return
	}
	if ob.o.Lost != nil {
		ob.o.Lost(g.parent, LostEvent{
			Key: g.key, Owner: g.obs.owner, Backend: ob.backend, Token: g.token,
			Reason: le.Reason, Held: g.obs.heldFor(), Err: le,
		})
	}
	ob.guardEnd(g, OutcomeLost, le)
}

// release reports g's release, which began at start and returned err,
// after the loss it found, if any, and the Guard's end.
func (ob observer) release(g *Guard, start time.Time, err error) {
	if ob.o == nil {
		return
	}
	if le, ok := errors.AsType[*LostError](err); ok {
		ob.lost(g, le, start) // nothing if the loss was reported before
	}
	if g.obs.markEnded(start) {
		outcome := OutcomeReleased
		if !errors.Is(g.Err(), ErrReleased) {
			outcome = OutcomeCanceled // the acquire's context ended first
		}
		ob.guardEnd(g, outcome, g.Err())
	}
	if ob.o.Release != nil {
		ob.o.Release(g.parent, ReleaseEvent{
			Key: g.key, Owner: g.obs.owner, Backend: ob.backend, Token: g.token,
			Outcome: outcomeOf(err, OutcomeReleased), Start: start, Duration: time.Since(start),
			Held: g.obs.heldFor(), Err: err,
		})
	}
}

// logAttrs returns the Guard's stable log attributes followed by more.
func (g *Guard) logAttrs(more ...any) []any {
	return append([]any{"key", g.key, "token", g.token, "owner", g.owner, "backend", g.c.opts.BackendName}, more...)
}

// logRenewFailure logs a transient renewal failure, which the scheduler
// retries.
func (g *Guard) logRenewFailure(attempt int, err error) {
	if g.c.log.Enabled(g.parent, slog.LevelDebug) {
		g.c.log.DebugContext(g.parent, "sqllock: renewal failed, retrying", g.logAttrs("attempt", attempt, "err", err)...)
	}
}

// logReleaseFailure logs a release that failed; the lease then ends at its
// deadline.
func (c *Client) logReleaseFailure(ctx context.Context, l Lease, err error) {
	c.log.WarnContext(ctx, "sqllock: release failed; the lease ends at its deadline",
		"key", l.Key, "token", l.Token, "owner", l.Owner, "backend", c.opts.BackendName, "err", err)
}
