package sqllock

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"time"
)

// Client takes leases from a [Backend] and keeps them alive. It is safe for
// concurrent use; create one per process (or per backend) and share it.
type Client struct {
	b        Backend
	opts     Options // resolved: every default filled in
	log      *slog.Logger
	obs      observer // reports to opts.Observer
	owner    string
	instance string // random, per Client: see request
	// ownerPrefix is owner + "/" + instance + "-": a lease's owner is it
	// and the acquire call's sequence number.
	ownerPrefix string
	seq         atomic.Uint64

	closing chan struct{} // closed by Close: wakes waiting Acquires

	sched *scheduler

	mu     sync.Mutex // guards closed, guards, watches, idle and each Guard's link
	closed bool
	guards *Guard // every Guard not yet released, linked through their link
	// watches are the acquire contexts watched (watch.go), by Done
	// channel; idle is the one with no Guard left, if any.
	watches map[<-chan struct{}]*parentWatch
	idle    *parentWatch
}

// New returns a Client over b. It validates opts and returns an error
// matching [ErrInvalidTTL] or [ErrInvalidOwner] for settings that cannot
// work; it does no I/O.
func New(b Backend, opts Options) (*Client, error) {
	if b == nil {
		return nil, errors.New("sqllock: New: nil Backend")
	}
	opts.TTL = cmp.Or(opts.TTL, DefaultTTL)
	opts.ReleaseTimeout = cmp.Or(opts.ReleaseTimeout, DefaultReleaseTimeout)
	if opts.MaxRenewBatch < 0 {
		return nil, fmt.Errorf("%w: MaxRenewBatch %d is negative", ErrInvalidOption, opts.MaxRenewBatch)
	}
	opts.MaxRenewBatch = cmp.Or(opts.MaxRenewBatch, DefaultMaxRenewBatch)
	if opts.Backoff == nil {
		opts.Backoff = DefaultBackoff
	}
	if opts.Owner == "" {
		opts.Owner = defaultOwner()
	}
	opts.BackendName = cmp.Or(opts.BackendName, backendName(b))
	if err := ValidateOwner(opts.Owner); err != nil {
		return nil, err
	}
	if len(opts.Owner) > MaxOwnerLen-ownerSuffixLen {
		return nil, fmt.Errorf("%w: %d bytes, more than %d", ErrInvalidOwner, len(opts.Owner), MaxOwnerLen-ownerSuffixLen)
	}
	if _, err := opts.settingsFor(nil); err != nil {
		return nil, err
	}
	if opts.ReleaseTimeout < 0 {
		return nil, &OptionError{Field: "ReleaseTimeout", Value: opts.ReleaseTimeout}
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	c := &Client{
		b: b, opts: opts, log: log, owner: opts.Owner,
		obs:      observer{o: opts.Observer, backend: opts.BackendName},
		instance: ownerInstance(),
		closing:  make(chan struct{}),
	}
	c.ownerPrefix = c.owner + "/" + c.instance + "-"
	c.sched = newScheduler(c)
	return c, nil
}

// Owner returns the client's owner name. Each lease's owner is this name
// followed by "/", a random number drawn once per Client, "-" and the
// acquire call's sequence number: unique per acquire call, also between
// Clients (in one process or many) given the same Options.Owner.
func (c *Client) Owner() string { return c.owner }

// ownerInstance draws the per-Client part of lease owners: 48 random bits.
func ownerInstance() string {
	return fmt.Sprintf("%012x", rand.Uint64()>>16)
}

// ownerSuffixLen bounds what request appends to the owner name:
// "/" + 12 hex digits + "-" + a uint64 in decimal (at most 20 digits).
const ownerSuffixLen = 1 + 12 + 1 + 20

func (c *Client) request(key string, s settings) AcquireRequest {
	// The instance part matters: a backend takes an acquire by the owner
	// of the current lease for the retry of that very call and hands the
	// same grant back, so two Clients sharing an owner name (say, the
	// host name) and a sequence number would both hold one lease.
	// One allocation: the owner is built in a buffer on the stack.
	var buf [MaxOwnerLen]byte
	b := append(buf[:0], c.ownerPrefix...)
	b = strconv.AppendUint(b, c.seq.Add(1), 10)
	return AcquireRequest{Key: key, TTL: s.ttl, Owner: string(b), Value: s.value, MinHold: s.minHold, Shared: s.shared}
}

// prepare validates a call's input before any I/O.
func (c *Client) prepare(key string, ao *AcquireOptions) (settings, error) {
	if err := ValidateKey(key); err != nil {
		return settings{}, err
	}
	s, err := c.opts.settingsFor(ao)
	if err != nil {
		return s, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return s, ErrClosed
	}
	return s, nil
}

// TryAcquire makes one attempt to take key. When the key is held it returns
// an error matching [ErrNotAcquired] (a [*HeldError] with the holder and its
// remaining time). On success the returned Guard renews the lease in the
// background until Release, loss, or the end of ctx (which also ends the
// Guard: pass a context that lives as long as the critical section).
//
// If the backend reports the outcome unknown ([ErrIndeterminate]),
// TryAcquire repeats the same request (same owner), which returns the grant
// if the first one was applied; if it still cannot tell, the error matches
// [ErrIndeterminate] and no Guard is handed out.
func (c *Client) TryAcquire(ctx context.Context, key string, opts *AcquireOptions) (g *Guard, err error) {
	s, err := c.prepare(key, opts)
	if err != nil {
		return nil, err
	}
	return c.acquire(ctx, c.request(key, s), s, 0)
}

// acquire is TryAcquire, Acquire and AcquirePermit after validation, for
// one key's request req: with no wait one attempt, an indeterminate outcome
// settled; with a positive wait (or WaitForever) waiting for the key.
func (c *Client) acquire(ctx context.Context, req AcquireRequest, s settings, wait time.Duration) (*Guard, error) {
	start := c.obs.now()
	a := acquireCall{req: req}
	var gr grant
	var err error
	attempts := 1
	if wait == 0 {
		gr, err = c.try(ctx, &a, true)
	} else {
		gr, attempts, err = c.wait(ctx, &a, s, wait)
	}
	var g *Guard
	if err == nil {
		g, err = c.hold(ctx, gr.l, gr.sent, s)
	}
	c.obs.acquire(ctx, req, wait != 0, start, attempts, g, err)
	return g, err
}

// Acquire takes key, waiting for it as opts.Wait says: with no Wait (nil
// opts, or zero) it makes one attempt, as [Client.TryAcquire] does, and
// returns an error matching [ErrNotAcquired] when the key is held; with a
// positive Wait it waits until it holds key, ctx ends, or Wait passes
// ([WaitForever]: until ctx ends). Between
// attempts it sleeps [Options.Backoff], capped by the holder's remaining
// lease, and wakes at once when the backend signals a release ([Watcher]).
// All attempts of one call use one owner, so an attempt whose reply was lost
// is recognised by the next; an attempt that takes longer than the TTL less
// the margin (when its grant could no longer be used) is abandoned as
// such. When the wait ends it returns the last
// [ErrNotAcquired] joined with the context's error.
//
// The Guard lives under ctx: a short-deadline ctx also ends the Guard. Bound
// only the wait with opts.Wait.
func (c *Client) Acquire(ctx context.Context, key string, opts *AcquireOptions) (g *Guard, err error) {
	s, err := c.prepare(key, opts)
	if err != nil {
		return nil, err
	}
	if opts == nil || opts.Wait == 0 {
		return c.acquire(ctx, c.request(key, s), s, 0)
	}
	req := c.request(key, s)
	// A waiting writer marks the key on each refused attempt, so that
	// readers that keep coming cannot starve it.
	req.Mark = !s.shared
	return c.acquire(ctx, req, s, opts.Wait)
}

// acquireCall is one acquire call as the loops that try, wait and settle
// see it: one key's request (a permit's too), or, with ma set, a set's,
// sent whole to ma. One loop of each serves both, so that a fix to how an
// attempt is waited for or settled reaches every acquire.
type acquireCall struct {
	req AcquireRequest      // one key's request, when ma is nil
	all MultiAcquireRequest // a set's request, with ma
	ma  MultiAcquirer       // the backend, for a set; nil for one key
}

// grant is what an acquire attempt was granted: one key's lease, or a
// set's leases, and when its request was sent.
type grant struct {
	l    Lease
	ls   []Lease
	sent time.Time
}

// keys names a's key, or a set's keys, in an error.
func (a *acquireCall) keys() any {
	if a.ma != nil {
		return a.all.Keys
	}
	return a.req.Key
}

// wait is an acquire with a positive wait, after validation: it returns
// the grant or the error and the number of attempts made. A single key is
// watched from the start; a set's watch follows the key that refused its
// last attempt.
func (c *Client) wait(ctx context.Context, a *acquireCall, s settings, wait time.Duration) (grant, int, error) {
	wctx := ctx
	if wait != WaitForever {
		var cancel context.CancelFunc
		wctx, cancel = context.WithTimeout(ctx, wait)
		defer cancel()
	}
	w, _ := c.b.(Watcher)
	var (
		wake    <-chan struct{}
		stop    = func() {}
		watched string
	)
	defer func() { stop() }()
	if w != nil && a.ma == nil {
		wake, stop = w.Watch(a.req.Key)
	}
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	var last error // the last attempt's error that says more than the context's
	for attempt := 1; ; attempt++ {
		// Each attempt is bounded by the TTL less the margin: a grant
		// whose reply came later could not be used (hold refuses
		// it), and an attempt that hangs (a dead connection, a stalled
		// database) must not stall the wait until ctx ends. An attempt
		// cut short is indeterminate: the next one, by the same owner,
		// settles it.
		actx, acancel := context.WithTimeout(wctx, s.ttl-s.margin)
		gr, err := c.attempt(actx, a, false)
		cut := err != nil && actx.Err() != nil && wctx.Err() == nil
		acancel()
		if err == nil {
			return gr, attempt, nil
		}
		if cut {
			err = fmt.Errorf("%w: the attempt took longer than the TTL less the margin: %w", ErrIndeterminate, err)
		}
		var he *HeldError
		switch {
		case errors.As(err, &he):
			if a.ma != nil && w != nil && he.Key != watched {
				// Watched from now on: a release before this only costs
				// the sleep below, bounded by the holder's remaining time.
				stop()
				wake, stop = w.Watch(he.Key)
				watched = he.Key
			}
		case wctx.Err() != nil && !errors.Is(err, ErrIndeterminate) && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)):
			// The wait ended under an attempt that cannot have taken the
			// key (not sent, a lease grant, a read): the wait's end, with
			// what the attempts before found, not the backend's failure.
			return grant{}, attempt, c.waitEnded(ctx, wctx, a, cmp.Or(last, err))
		case errors.Is(err, ErrIndeterminate), errors.Is(err, ErrUnavailable):
			if a.ma != nil {
				c.log.DebugContext(ctx, "sqllock: acquire attempt of a set failed, retrying", "keys", a.all.Keys, "owner", a.all.Owner, "backend", c.opts.BackendName, "attempt", attempt, "err", err)
			} else {
				c.log.DebugContext(ctx, "sqllock: acquire attempt failed, retrying", "key", a.req.Key, "owner", a.req.Owner, "backend", c.opts.BackendName, "attempt", attempt, "err", err)
			}
		default:
			return grant{}, attempt, err
		}
		last = err
		if wctx.Err() != nil {
			return grant{}, attempt, c.waitEnded(ctx, wctx, a, err)
		}
		d := c.opts.Backoff(attempt)
		if he != nil && he.Remaining > 0 {
			d = min(d, he.Remaining)
		}
		timer.Reset(max(d, 0))
		select {
		case <-wctx.Done():
			return grant{}, attempt, c.waitEnded(ctx, wctx, a, err)
		case <-c.closing:
			return grant{}, attempt, ErrClosed
		case <-timer.C:
		case <-wake:
			timer.Stop() // since Go 1.23 a stopped timer delivers no stale tick
		}
	}
}

// waitEnded builds an acquire's error when its wait ends. If the last
// attempt was indeterminate, it first settles it (see try).
func (c *Client) waitEnded(ctx, wctx context.Context, a *acquireCall, last error) error {
	if errors.Is(last, ErrIndeterminate) {
		// wctx has ended: settle with a context of its own, or the first
		// attempt would not even be sent and a grant that was applied would
		// hold the key for a whole TTL.
		if _, err := c.settle(wctx, a, last); err != nil {
			last = err
		}
	}
	if ctx.Err() == nil && wctx.Err() != nil {
		// opts.Wait passed: report it as a deadline.
		return errors.Join(last, context.DeadlineExceeded)
	}
	return errors.Join(last, context.Cause(ctx))
}

// attempt sends one acquire request of a (settle: a repeat that settles an
// indeterminate one); one key's is reported.
func (c *Client) attempt(ctx context.Context, a *acquireCall, settle bool) (grant, error) {
	if a.ma != nil {
		ls, sent, err := c.attemptAll(ctx, a.ma, a.all)
		return grant{ls: ls, sent: sent}, err
	}
	sent := time.Now()
	l, err := c.send(ctx, a.req)
	c.obs.acquireAttempt(ctx, a.req, settle, sent, l, err)
	return grant{l: l, sent: sent}, err
}

// releaseQuietlyGrant releases what an attempt of a was granted.
func (c *Client) releaseQuietlyGrant(ctx context.Context, a *acquireCall, gr grant) {
	if a.ma != nil {
		c.releaseAllQuietly(ctx, gr.ls)
		return
	}
	c.releaseQuietly(ctx, gr.l)
}

// hold hands out the Guard of lease l, granted to an acquire request sent
// at sent: it refuses a grant whose reply came after the local deadline,
// and releases the lease of a Client closed meanwhile; else it reports
// the Guard, adds it to the Client's Guards, schedules its renewals and
// ends it with parent.
func (c *Client) hold(parent context.Context, l Lease, sent time.Time, s settings) (*Guard, error) {
	g := newGuard(c, parent, l, sent, s)
	// time.Until reads only the monotonic clock: half the cost of
	// time.Now().Before, which reads the wall clock too.
	if time.Until(g.slot.expAt) <= 0 {
		// The reply came too late to use the lease safely.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(parent), c.opts.ReleaseTimeout)
		defer cancel()
		c.releaseQuietly(rctx, l)
		return nil, &LostError{Key: l.Key, Token: l.Token, Reason: LostExpired,
			Err: errors.New("the acquire reply arrived after the local deadline")}
	}
	c.obs.guardStart(g)
	c.mu.Lock()
	closed := c.closed
	if !closed {
		// Linked and scheduled under one hold of mu: a Close that comes
		// between the two would release the Guard before it is scheduled,
		// and the scheduler would then renew a released lease after Close.
		c.link(g)
		c.sched.add(g)
	}
	c.mu.Unlock()
	if afterHold != nil && !closed {
		afterHold(c)
	}
	if closed {
		g.releaseUnshared(ErrClosed)
		return nil, ErrClosed
	}
	c.watchParent(g)
	return g, nil
}

// afterHold, when set (by tests only), runs in hold once the Client's mu
// is released after linking the Guard: where a concurrent Close can come.
var afterHold func(*Client)

// try makes one acquire attempt. With settle set, an indeterminate outcome
// is settled (see settle).
func (c *Client) try(ctx context.Context, a *acquireCall, settle bool) (grant, error) {
	gr, err := c.attempt(ctx, a, false)
	if err == nil || !settle || !errors.Is(err, ErrIndeterminate) {
		return gr, err
	}
	return c.settle(ctx, a, err)
}

// settle settles an acquire whose outcome err was indeterminate by
// repeating the same request (same owner) a few times: the backend returns
// the grant (a set's whole) if the lost attempt was applied. If ctx has
// ended (before or meanwhile), the repeats run under a context of their
// own bounded by ReleaseTimeout, and a grant they find is released at once
// and the context's error returned, so no orphan lease outlives the call.
func (c *Client) settle(ctx context.Context, a *acquireCall, err error) (grant, error) {
	sent := time.Now()
	sctx := ctx
	if ctx.Err() != nil {
		rctx := c.releaseContext(ctx)
		defer rctx.stop()
		sctx = rctx
	}
	const repeats = 5
	for attempt := 1; attempt <= repeats && sctx.Err() == nil; attempt++ {
		if attempt > 1 {
			sleep(sctx, c.opts.Backoff(attempt-1))
			if sctx.Err() != nil {
				break
			}
		}
		gr, err2 := c.attempt(sctx, a, true)
		sent = gr.sent
		switch {
		case err2 == nil && ctx.Err() != nil:
			c.releaseQuietlyGrant(sctx, a, gr)
			return grant{sent: sent}, errors.Join(context.Cause(ctx), fmt.Errorf("sqllock: acquire of %q settled and released after its context ended", a.keys()))
		case err2 == nil:
			return gr, nil
		case errors.Is(err2, ErrIndeterminate), errors.Is(err2, ErrUnavailable), anonymousHolder(err2), cutByContext(err2):
			err = errors.Join(ErrIndeterminate, err2)
		default:
			return grant{sent: sent}, err2 // settled: not ours (or a permanent error)
		}
	}
	return grant{sent: sent}, err
}

// anonymousHolder reports whether err is a refusal that names no holder
// (a backend that lost a race for the row and could not see who won). It
// does not settle an indeterminate acquire: the holder it could not name may
// be the lost attempt itself.
func anonymousHolder(err error) bool {
	var he *HeldError
	return errors.As(err, &he) && he.Owner == ""
}

// cutByContext reports a repeat that a context ended before it was
// answered (not sent, or a read cut short) and that no holder refused: it
// tells nothing of the lost attempt, which may still hold the key.
func cutByContext(err error) bool {
	var he *HeldError
	return (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)) && !errors.As(err, &he)
}

func (c *Client) releaseQuietly(ctx context.Context, l Lease) {
	if err := c.b.Release(ctx, l); err != nil {
		c.logReleaseFailure(ctx, l, err)
	}
}

// List reports the keys that start with prefix (an empty prefix lists
// every key), in key order, as the backend sees them now: the latest token
// of each, its owner, and whether it is held with how long it has left.
// The prefix is validated before any I/O ([ValidatePrefix]).
func (c *Client) List(ctx context.Context, prefix string) ([]LockInfo, error) {
	if err := ValidatePrefix(prefix); err != nil {
		return nil, err
	}
	return c.b.List(ctx, prefix)
}

// Watch returns a channel that receives a value when the backend signals
// a release of key, and a function that stops watching, when the backend
// can signal releases ([Watcher]); ok is false when it cannot (then poll).
func (c *Client) Watch(key string) (ch <-chan struct{}, stop func(), ok bool) {
	w, ok := c.b.(Watcher)
	if !ok {
		return nil, func() {}, false
	}
	ch, stop = w.Watch(key)
	return ch, stop, true
}

// Do acquires key (one attempt, or waiting as opts.Wait says: see
// [Client.Acquire]), runs fn with a context
// that is cancelled when the lease is lost, and releases the lease when fn
// returns (also if fn panics). When the key is held (and Wait, if any,
// passes) it returns an error matching [ErrNotAcquired] without running
// fn: several replicas that all call Do with nil options for one job run
// it once. It returns fn's error; if the lease was lost
// while fn ran, the error also matches [ErrLeaseLost], so the caller learns
// that fn's work may have overlapped another holder's.
func (c *Client) Do(ctx context.Context, key string, opts *AcquireOptions, fn func(ctx context.Context, g *Guard) error) (err error) {
	g, err := c.Acquire(ctx, key, opts)
	if err != nil {
		return err
	}
	defer func() {
		rerr := g.Release(context.WithoutCancel(ctx))
		switch {
		case rerr == nil:
		case err == nil:
			err = rerr
		case errors.Is(rerr, ErrLeaseLost) && !errors.Is(err, ErrLeaseLost):
			err = errors.Join(err, rerr)
		}
	}()
	return fn(g.Context(), g)
}

// Close releases every Guard still held and makes later calls fail with
// [ErrClosed]. The releases run in parallel under one bound: ctx and
// Options.ReleaseTimeout, or ReleaseTimeout alone if ctx has already ended.
// It does not close the backend. Calling it again returns nil.
func (c *Client) Close(ctx context.Context) error {
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return nil
	}
	c.closed = true
	close(c.closing)
	var guards []*Guard
	for g := c.guards; g != nil; g = g.link.next {
		guards = append(guards, g)
	}
	c.mu.Unlock()
	rctx := c.releaseContext(ctx)
	defer rctx.stop()
	errs := make([]error, len(guards))
	var wg sync.WaitGroup
	for i, g := range guards {
		wg.Go(func() {
			if err := g.release(rctx); !errors.Is(err, ErrLeaseLost) {
				errs[i] = err
			}
		})
	}
	wg.Wait()
	c.sched.stopIfIdle()
	c.stopWatches()
	return errors.Join(errs...)
}

// releaseContext bounds a release made for the caller: by ctx and
// ReleaseTimeout, or, when ctx has already ended (a request that timed out,
// docs/pitfalls.md#16), by ReleaseTimeout alone, so that the release is still sent.
// The caller calls stop when done with it, as with a context.CancelFunc.
func (c *Client) releaseContext(ctx context.Context) *releaseCtx {
	rc := new(releaseCtx)
	c.initReleaseContext(rc, ctx)
	return rc
}

// initReleaseContext makes rc (zero, not yet shared) what releaseContext
// returns.
func (c *Client) initReleaseContext(rc *releaseCtx, ctx context.Context) {
	if ctx.Err() != nil {
		ctx = context.WithoutCancel(ctx)
	}
	rc.init(ctx, c.opts.ReleaseTimeout)
}

// guardLink is a Guard's place in its Client's list of Guards and in the
// watch of its acquire context (watch.go), guarded by the Client's mu.
type guardLink struct {
	prev, next *Guard
	watch      *parentWatch // nil when parent never ends, or once it has ended, been released or lost
}

// linked reports whether g is in the client's Guards. Called with c.mu
// held.
func (c *Client) linked(g *Guard) bool { return g.link.prev != nil || c.guards == g }

// link adds g to the client's Guards. Called with c.mu held.
func (c *Client) link(g *Guard) {
	g.link.next = c.guards
	if c.guards != nil {
		c.guards.link.prev = g
	}
	c.guards = g
}

// forget removes g from the client's Guards, if it is there.
func (c *Client) forget(g *Guard) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.linked(g) {
		return
	}
	l := &g.link
	if l.prev != nil {
		l.prev.link.next = l.next
	} else {
		c.guards = l.next
	}
	if l.next != nil {
		l.next.link.prev = l.prev
	}
	l.prev, l.next = nil, nil
}

// sleep waits for d, or until ctx ends, whichever is first. (The backends
// share internal/wait.Sleep; sqllock depends on the standard library only.)
func sleep(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}
