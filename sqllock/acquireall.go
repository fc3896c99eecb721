package sqllock

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"
)

// GuardSet is the Guards of one [Client.AcquireAll]: one ordinary [Guard]
// per key, each with its own lease and fencing token, granted together.
//
// The set is lost together: its [GuardSet.Context] ends at the first end
// of any member (a loss, a release, the acquire context's end), with that
// member's cause, so that the work done under the set stops as soon as one
// of its keys can no longer be trusted. The other members are not ended
// by it: their leases stay held, and renewed, until [GuardSet.Release]
// (or their own loss), so that no other holder can take those keys while
// the holder is still stopping. Each member reports its own state
// ([Guard.Err]). The members come due for renewal together (one acquire,
// one send time, one renew interval) and the Client's scheduler renews
// them in one batch on a backend with [BatchRenewer].
type GuardSet struct {
	guards []*Guard // in the order of the keys given to AcquireAll
	ctx    context.Context
	cancel context.CancelCauseFunc // called by a member's end, and by Release
}

// newGuardSet makes the set of gs, handed out: its context ends at the
// first end of a member.
func newGuardSet(parent context.Context, gs []*Guard) *GuardSet {
	ctx, cancel := context.WithCancelCause(parent)
	for _, g := range gs {
		gctx := g.Context()
		context.AfterFunc(gctx, func() { cancel(context.Cause(gctx)) })
	}
	return &GuardSet{guards: gs, ctx: ctx, cancel: cancel}
}

// Guards returns the set's Guards, in the order of the keys given to
// AcquireAll.
func (s *GuardSet) Guards() []*Guard { return slices.Clone(s.guards) }

// Guard returns the Guard of key, or nil when key is not in the set.
func (s *GuardSet) Guard(key string) *Guard {
	for _, g := range s.guards {
		if g.key == key {
			return g
		}
	}
	return nil
}

// Context returns a context that ends at the first end of any member of
// the set (a goroutine hop after it): its cause is that member's ([Guard.Context]): a [*LostError]
// naming the lost key, [ErrReleased], or the acquire context's cause.
func (s *GuardSet) Context() context.Context { return s.ctx }

// Done is shorthand for s.Context().Done().
func (s *GuardSet) Done() <-chan struct{} { return s.ctx.Done() }

// Err returns nil while every member holds its lease, else the cause of
// the first member's end (see [GuardSet.Context]). It reads the members
// themselves: the set's context ends a goroutine hop after the first
// member's (context.AfterFunc), Err at once.
func (s *GuardSet) Err() error {
	if s.ctx.Err() != nil {
		return context.Cause(s.ctx)
	}
	for _, g := range s.guards {
		if err := g.Err(); err != nil {
			return err
		}
	}
	return nil
}

// Release releases every member of the set, at once, and returns their
// errors joined ([Guard.Release]: an error matching [ErrLeaseLost] for a
// member that was lost, so that the caller learns its work may have
// overlapped another holder's). It is idempotent, as Guard.Release is.
//
// On a backend with [MultiReleaser] the members still to release go in
// one call (one statement, one round trip); each member's result is the
// one its own Guard.Release would have returned, and a member released
// before (by its own Release, or on its acquire context's end) reports
// that release. Without it, each member is released with its own call,
// all at once.
func (s *GuardSet) Release(ctx context.Context) error {
	var errs []error
	if mr, ok := s.guards[0].c.b.(MultiReleaser); ok && len(s.guards) > 1 {
		errs = s.releaseTogether(ctx, mr)
	} else {
		errs = make([]error, len(s.guards))
		var wg sync.WaitGroup
		for i, g := range s.guards {
			wg.Go(func() { errs[i] = g.Release(ctx) })
		}
		wg.Wait()
	}
	s.cancel(ErrReleased) // a no-op: the first member's end came first
	return errors.Join(errs...)
}

// releaseTogether is Release through mr: each member goes through
// Guard.Release's steps, the backend's part in one call for them all.
func (s *GuardSet) releaseTogether(ctx context.Context, mr MultiReleaser) []error {
	c := s.guards[0].c
	errs := make([]error, len(s.guards))
	type member struct {
		i    int
		g    *Guard
		b    *batch
		last bool
	}
	var mine []member
	var others sync.WaitGroup
	for i, g := range s.guards {
		b, last, ok := g.startRelease()
		if !ok {
			// Another call releases it: its answer, as Guard.Release.
			others.Go(func() { errs[i] = g.Release(ctx) })
			continue
		}
		mine = append(mine, member{i, g, b, last})
	}
	if len(mine) > 0 {
		rctx := c.releaseContext(ctx)
		var wg sync.WaitGroup
		for _, m := range mine {
			wg.Go(func() { m.g.awaitBatch(rctx, m.b, true, m.last) })
		}
		wg.Wait()
		gs := make([]*Guard, len(mine))
		for k, m := range mine {
			gs[k] = m.g
		}
		start := c.obs.now()
		res := c.releaseGuards(rctx, mr, gs)
		for k, m := range mine {
			c.obs.release(m.g, start, res[k])
			c.forget(m.g)
			m.g.rel.finish(res[k])
			errs[m.i] = res[k]
		}
		for _, m := range mine {
			wg.Go(func() { m.g.awaitBatch(rctx, m.b, false, false) })
		}
		wg.Wait()
		rctx.stop()
	}
	others.Wait()
	return errs
}

// releaseGuards is releaseLease for the Guards gs (ended, finishing, one
// set's) in calls of mr: one for all, and again for those whose answer
// was transient, as releaseLease sends one lease again.
func (c *Client) releaseGuards(ctx context.Context, mr MultiReleaser, gs []*Guard) []error {
	leases := make([]Lease, len(gs))
	losts := make([]*LostError, len(gs))
	out := make([]error, len(gs))
	var todo []int
	for i, g := range gs {
		var send bool
		leases[i], losts[i], send = g.releaseInput()
		if send {
			todo = append(todo, i)
		}
	}
	for attempt := 1; len(todo) > 0; attempt++ {
		answers := c.releaseLeases(ctx, mr, leases, todo)
		var again []int
		for k, i := range todo {
			out[i] = answers[k]
			if answers[k] != nil && releaseRetryable(answers[k]) && attempt < releaseAttempts {
				again = append(again, i)
			}
		}
		if todo = again; len(todo) == 0 {
			break
		}
		sleep(ctx, c.opts.Backoff(attempt))
		if ctx.Err() != nil {
			break
		}
	}
	for i, g := range gs {
		out[i] = g.releaseOutcome(leases[i], losts[i], out[i])
	}
	return out
}

// releaseLeases sends the release of leases[todo[k]] for every k, in one
// call, and returns their answers in todo's order.
func (c *Client) releaseLeases(ctx context.Context, mr MultiReleaser, leases []Lease, todo []int) []error {
	if len(todo) == 1 {
		return []error{c.b.Release(ctx, leases[todo[0]])}
	}
	ls := make([]Lease, len(todo))
	for k, i := range todo {
		ls[k] = leases[i]
	}
	answers, err := mr.ReleaseAll(ctx, ls)
	if err == nil && len(answers) != len(ls) {
		err = fmt.Errorf("%w: sqllock: the backend answered %d of %d releases", ErrIndeterminate, len(answers), len(ls))
	}
	if err != nil {
		answers = make([]error, len(ls))
		for k := range answers {
			answers[k] = err
		}
	}
	return answers
}

// AcquireAll takes every key of keys, all or none, in one call to the
// backend's [MultiAcquirer] (one statement on the SQL backends; the keys
// are taken in a fixed order there, so that overlapping sets never
// deadlock), and returns their Guards as a [GuardSet]. Each key gets its
// own lease and fencing token, as [Client.Acquire] of it alone would.
//
// It waits as [Client.Acquire] does, as opts.Wait says: with no Wait one
// attempt, which returns an error matching [ErrNotAcquired] (a
// [*HeldError] naming the first held key in key order and its holder)
// when a key is held; with a positive Wait (or [WaitForever]) it tries
// again until every key is free, ctx ends or Wait passes, sleeping
// [Options.Backoff] capped by the refusing holder's remaining lease, and
// waking early when the backend signals the release of the key that
// refused it last ([Watcher]). An outcome the backend reports unknown
// ([ErrIndeterminate]) is settled by repeating the same request (the same
// owner gets the same tokens back), as for Acquire.
//
// The keys are validated before any I/O: at least one, at most
// [MaxKeysPerAcquire], each valid, none twice (errors matching
// [ErrInvalidKey]). opts applies to every key; a MinHold is refused
// ([ErrInvalidOption]): a set of keys takes no minimum hold. A backend
// without [MultiAcquirer] gives an error matching
// [ErrMultiAcquireUnsupported] naming it, before any I/O. The observer
// sees one acquire event per key, each with the set's outcome.
func (c *Client) AcquireAll(ctx context.Context, keys []string, opts *AcquireOptions) (*GuardSet, error) {
	req, s, err := c.prepareAll(keys, opts)
	if err != nil {
		return nil, err
	}
	ma, ok := c.b.(MultiAcquirer)
	if !ok {
		return nil, fmt.Errorf("%w: backend %s", ErrMultiAcquireUnsupported, c.opts.BackendName)
	}
	start := c.obs.now()
	waits := opts != nil && opts.Wait != 0
	a := acquireCall{all: req, ma: ma}
	var gr grant
	attempts := 1
	if !waits {
		gr, err = c.try(ctx, &a, true)
	} else {
		gr, attempts, err = c.wait(ctx, &a, s, opts.Wait)
	}
	var set *GuardSet
	if err == nil {
		set, err = c.holdAll(ctx, gr.ls, gr.sent, s)
	}
	if c.obs.on() {
		for i, k := range req.Keys {
			var g *Guard
			if set != nil {
				g = set.guards[i]
			}
			c.obs.acquire(ctx, AcquireRequest{Key: k, TTL: req.TTL, Owner: req.Owner, Value: req.Value}, waits, start, attempts, g, err)
		}
	}
	return set, err
}

// prepareAll validates AcquireAll's input before any I/O and builds its
// request.
func (c *Client) prepareAll(keys []string, ao *AcquireOptions) (MultiAcquireRequest, settings, error) {
	s, err := c.opts.settingsFor(ao)
	if err != nil {
		return MultiAcquireRequest{}, s, err
	}
	if s.minHold != 0 {
		return MultiAcquireRequest{}, s, fmt.Errorf("%w: AcquireAll takes no MinHold (a set of keys has no minimum hold)", ErrInvalidOption)
	}
	if s.shared {
		return MultiAcquireRequest{}, s, fmt.Errorf("%w: AcquireAll takes no Shared", ErrInvalidOption)
	}
	one := c.request("", s)
	req := MultiAcquireRequest{Keys: slices.Clone(keys), TTL: one.TTL, Owner: one.Owner, Value: one.Value}
	if err := req.Validate(); err != nil {
		return req, s, err
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return req, s, ErrClosed
	}
	return req, s, nil
}

// attemptAll sends one acquire of the set (attempt, for a set).
func (c *Client) attemptAll(ctx context.Context, ma MultiAcquirer, req MultiAcquireRequest) ([]Lease, time.Time, error) {
	sent := time.Now()
	ls, err := ma.TryAcquireAll(ctx, req)
	if err == nil && len(ls) != len(req.Keys) {
		// Never hand out part of a set.
		return nil, sent, fmt.Errorf("%w: sqllock: the backend granted %d leases for a set of %d keys", ErrIndeterminate, len(ls), len(req.Keys))
	}
	return ls, sent, err
}

func (c *Client) releaseAllQuietly(ctx context.Context, ls []Lease) {
	var wg sync.WaitGroup
	for _, l := range ls {
		wg.Go(func() { c.releaseQuietly(ctx, l) })
	}
	wg.Wait()
}

// holdAll is hold for a set: the Guards of leases ls, granted to one
// request sent at sent, handed out together or not at all.
func (c *Client) holdAll(parent context.Context, ls []Lease, sent time.Time, s settings) (*GuardSet, error) {
	gs := make([]*Guard, len(ls))
	for i, l := range ls {
		gs[i] = newGuard(c, parent, l, sent, s)
	}
	if time.Until(gs[0].slot.expAt) <= 0 {
		// The reply came too late to use the leases safely.
		rctx, cancel := context.WithTimeout(context.WithoutCancel(parent), c.opts.ReleaseTimeout)
		defer cancel()
		c.releaseAllQuietly(rctx, ls)
		return nil, &LostError{Key: ls[0].Key, Token: ls[0].Token, Reason: LostExpired,
			Err: errors.New("the acquire reply arrived after the local deadline")}
	}
	for _, g := range gs {
		c.obs.guardStart(g)
	}
	c.mu.Lock()
	closed := c.closed
	if !closed {
		// As in hold: linked and scheduled under one hold of mu.
		for _, g := range gs {
			c.link(g)
			c.sched.add(g)
		}
	}
	c.mu.Unlock()
	if closed {
		for _, g := range gs {
			g.releaseUnshared(ErrClosed)
		}
		return nil, ErrClosed
	}
	for _, g := range gs {
		c.watchParent(g)
	}
	return newGuardSet(parent, gs), nil
}
