package sqllock

import (
	"container/heap"
	"context"
	"errors"
	"sync"
	"time"
)

// scheduler renews every Guard of one Client, replacing a goroutine and
// timers per Guard: one timer, two heaps and, while renewals are in
// flight, a goroutine per batch.
//
// A Guard is due for renewal one renew interval after the send time of its
// last successful renewal (or acquire). When the earliest Guard comes due,
// every Guard due within its window ([Options.RenewWindow]) is renewed with
// it, in one call to the backend's [BatchRenewer] (at most
// [Options.MaxRenewBatch] leases a call), or, for a backend without it, a
// TryRenew per Guard. Each Guard's local deadline counts from the send time
// of the batch that renewed it (G3), and each Guard's outcome is applied on
// its own: a lost lease ends its Guard only, a transient failure retries
// that Guard with its own backoff.
//
// The same timer ends each Guard at its local deadline, to the instant,
// unless a renewal succeeded first: the second heap orders the Guards by
// local deadline.
//
// Release never cancels a batch that still carries another live lease: it
// waits for the batch that carries its lease (bounded, see Guard.Release),
// so a release costs no pooled connection and is the lease's last
// operation at the backend. A batch's context ends when its attempt has
// had half of what its earliest lease has left (attemptDeadline), at the
// latest local deadline among its leases at most: a call that hangs is
// abandoned then and its leases retried, as after any transient error. Only a batch that no live lease needs any more (every one
// released or lost while it was still in flight after the wait, as with a
// backend that does not answer) is cancelled, so that nothing outlives the
// client's last Guard (G8). When the last Guard goes, the timer stays set
// (a pair of acquire and release then costs no timer update): it fires
// once for nothing, and no goroutine waits for it; Close stops it.
type scheduler struct {
	c  *Client
	br BatchRenewer // nil: one TryRenew per Guard

	mu    sync.Mutex // guards the fields below and the Guards' schedSlot
	due   guardHeap  // Guards waiting for their next renewal, by due
	exp   guardHeap  // live Guards, by local deadline
	timer *time.Timer
	at    time.Time // when timer fires; zero while it is stopped
	// maxWindow is the longest renew window of any Guard scheduled so far:
	// fire looks that far ahead in the due heap.
	maxWindow time.Duration
}

// schedSlot is a Guard's place in the scheduler, guarded by the
// scheduler's mu (newGuard sets it before the Guard is shared).
type schedSlot struct {
	due      time.Time // the next renewal
	expAt    time.Time // the local deadline, as the deadline heap has it
	dueIdx   int32     // index in the due heap, -1 if not there
	expIdx   int32     // index in the deadline heap, -1 if not there
	inFlight *batch    // the batch carrying this lease's renewal, if any
	alone    bool      // renew it next on its own (TryRenew), not in a batch
}

// batch is one call to the backend in flight: a batch renewal, or one
// TryRenew.
type batch struct {
	done   chan struct{} // closed when every result has been applied
	ctx    context.Context
	cancel context.CancelFunc
	until  time.Time // ctx's deadline
	live   int       // leases in it not yet released or lost; guarded by the scheduler's mu
}

// timedOut reports whether the batch's attempt reached its bound
// (attemptDeadline) before it returned.
func (b *batch) timedOut() bool {
	return b != nil && errors.Is(b.ctx.Err(), context.DeadlineExceeded)
}

// abandon cancels the batch, which no live lease needs any more, unless its
// deadline has come: then its context ends by itself, at the same instant,
// and a cancel could race that end (and make the error it returns depend
// on scheduling).
func (b *batch) abandon() {
	if time.Now().Before(b.until) {
		b.cancel()
	}
}

// guardHeap is a binary min-heap of Guards; byDue selects the order (due,
// or local deadline) and which index field each Guard keeps its place in.
type guardHeap struct {
	gs    []*Guard
	byDue bool
}

func (h *guardHeap) key(g *Guard) time.Time {
	if h.byDue {
		return g.slot.due
	}
	return g.slot.expAt
}

func (h *guardHeap) setIdx(i int) {
	if h.byDue {
		h.gs[i].slot.dueIdx = int32(i)
	} else {
		h.gs[i].slot.expIdx = int32(i)
	}
}

func (h *guardHeap) idx(g *Guard) int {
	if h.byDue {
		return int(g.slot.dueIdx)
	}
	return int(g.slot.expIdx)
}

// Len, Less, Swap, Push and Pop implement heap.Interface; the scheduler
// uses push, remove and fix.
func (h *guardHeap) Len() int           { return len(h.gs) }
func (h *guardHeap) Less(i, j int) bool { return h.key(h.gs[i]).Before(h.key(h.gs[j])) }

func (h *guardHeap) Swap(i, j int) {
	h.gs[i], h.gs[j] = h.gs[j], h.gs[i]
	h.setIdx(i)
	h.setIdx(j)
}

func (h *guardHeap) Push(x any) {
	h.gs = append(h.gs, x.(*Guard))
	h.setIdx(len(h.gs) - 1)
}

func (h *guardHeap) Pop() any {
	last := len(h.gs) - 1
	g := h.gs[last]
	h.gs[last] = nil
	h.gs = h.gs[:last]
	if h.byDue {
		g.slot.dueIdx = -1
	} else {
		g.slot.expIdx = -1
	}
	return g
}

func (h *guardHeap) push(g *Guard) { heap.Push(h, g) }

// remove takes g out of the heap if it is in it.
func (h *guardHeap) remove(g *Guard) {
	if i := h.idx(g); i >= 0 {
		heap.Remove(h, i)
	}
}

// fix restores the order after g's key changed, or pushes g.
func (h *guardHeap) fix(g *Guard) {
	if i := h.idx(g); i >= 0 {
		heap.Fix(h, i)
		return
	}
	h.push(g)
}

func (h *guardHeap) top() *Guard { return h.gs[0] }

func newScheduler(c *Client) *scheduler {
	s := &scheduler{c: c, due: guardHeap{byDue: true}}
	s.br, _ = c.b.(BatchRenewer)
	return s
}

// add schedules a new Guard as newGuard set its slot: its first renewal
// at due (none when zero: a Guard capped by its max hold already), its end
// at expAt.
func (s *scheduler) add(g *Guard) {
	s.mu.Lock()
	s.maxWindow = max(s.maxWindow, g.s.window)
	if !g.slot.due.IsZero() {
		s.due.push(g)
	}
	s.exp.push(g)
	s.armLocked()
	s.mu.Unlock()
}

// remove unschedules g (released or lost) and returns the batch carrying
// its renewal, if one is in flight, and whether g was the last live lease
// in it.
func (s *scheduler) remove(g *Guard) (b *batch, last bool) {
	s.mu.Lock()
	s.due.remove(g)
	s.exp.remove(g)
	b = g.slot.inFlight
	if b != nil {
		b.live--
		last = b.live == 0
		g.slot.inFlight = nil
	}
	// The timer is left as it is, even with no Guard left: it fires once
	// for nothing (see fire), while stopping it here and arming it again
	// at the next add would cost each acquire-release pair two updates
	// of the runtime's timer heap and two clock reads. Close stops it.
	s.mu.Unlock()
	return b, last
}

// stopIfIdle stops the timer when no Guard is scheduled: after Close,
// nothing of the Client's stays armed.
func (s *scheduler) stopIfIdle() {
	s.mu.Lock()
	if len(s.exp.gs) == 0 && len(s.due.gs) == 0 && !s.at.IsZero() {
		s.timer.Stop()
		s.at = time.Time{}
	}
	s.mu.Unlock()
}

// armLocked sets the timer for the next event: the earliest due renewal or
// local deadline. A timer set earlier than needed only fires once for
// nothing; one set later is moved.
func (s *scheduler) armLocked() {
	var next time.Time
	if len(s.due.gs) > 0 {
		next = s.due.top().slot.due
	}
	if len(s.exp.gs) > 0 {
		if e := s.exp.top().slot.expAt; next.IsZero() || e.Before(next) {
			next = e
		}
	}
	switch {
	case next.IsZero():
		if !s.at.IsZero() {
			s.timer.Stop()
			s.at = time.Time{}
		}
	case s.at.IsZero() || next.Before(s.at):
		s.at = next
		if s.timer == nil {
			s.timer = time.AfterFunc(time.Until(next), s.fire)
		} else {
			s.timer.Reset(time.Until(next))
		}
	}
}

// fire runs on the timer's goroutine: it ends the Guards whose local
// deadline has come, and sends the renewals that are due.
func (s *scheduler) fire() {
	now := time.Now()
	s.mu.Lock()
	s.at = time.Time{}
	var expired []*Guard
	for len(s.exp.gs) > 0 && !now.Before(s.exp.top().slot.expAt) {
		g := s.exp.top()
		s.exp.remove(g)
		s.due.remove(g)
		expired = append(expired, g)
	}
	var sends []send
	var later []*Guard
	maxBatch := s.c.opts.MaxRenewBatch
	var cur *send
	for len(s.due.gs) > 0 && !s.due.top().slot.due.After(now.Add(s.maxWindow)) {
		g := s.due.top()
		s.due.remove(g)
		if g.slot.due.After(now.Add(g.s.window)) {
			later = append(later, g) // its own window is shorter
			continue
		}
		if s.br == nil || g.slot.alone {
			g.slot.alone = false
			sends = append(sends, send{b: &batch{done: make(chan struct{})}, gs: []*Guard{g}, single: true, first: g.slot.expAt, until: g.slot.expAt})
			cur = nil
			g.slot.inFlight = sends[len(sends)-1].b
			continue
		}
		if cur == nil || len(cur.gs) == maxBatch {
			sends = append(sends, send{b: &batch{done: make(chan struct{})}})
			cur = &sends[len(sends)-1]
		}
		cur.gs = append(cur.gs, g)
		if g.slot.expAt.After(cur.until) {
			cur.until = g.slot.expAt
		}
		if cur.first.IsZero() || g.slot.expAt.Before(cur.first) {
			cur.first = g.slot.expAt
		}
		g.slot.inFlight = cur.b
	}
	for _, g := range later {
		s.due.push(g)
	}
	for i := range sends {
		b := sends[i].b
		b.live = len(sends[i].gs)
		b.until = attemptDeadline(now, sends[i].first, sends[i].until)
		b.ctx, b.cancel = context.WithDeadline(context.Background(), b.until)
	}
	s.armLocked()
	s.mu.Unlock()

	for _, g := range expired {
		g.localDeadlinePassed()
	}
	for i := range sends {
		if i == len(sends)-1 {
			s.run(sends[i]) // on this goroutine
			break
		}
		go s.run(sends[i])
	}
}

// send is one batch to send: its Guards, and what bounds its context.
type send struct {
	b      *batch
	gs     []*Guard
	single bool      // a TryRenew of gs[0] alone
	first  time.Time // the earliest local deadline among gs
	until  time.Time // the latest local deadline among gs
}

// minAttempt is the least time a renewal attempt is given, however little
// its lease has left (never past the lease's local deadline).
const minAttempt = 10 * time.Millisecond

// attemptDeadline bounds one renewal attempt sent at now: it may take half
// of the time left until first (the earliest local deadline among the
// leases it carries), at least minAttempt, and never runs past until (the
// latest). An attempt that hangs (a half-open connection, a stalled
// server) is abandoned then as transient, and its leases are renewed again
// (the same tokens, so a repeat is safe) on another connection: each retry
// gets half of what is left, so a lease survives several stuck
// connections in a row and is never lost to one.
func attemptDeadline(now, first, until time.Time) time.Time {
	if mutantOn(mutantRenewUnbounded) {
		return until
	}
	d := now.Add(max(first.Sub(now)/2, minAttempt))
	if d.After(until) {
		return until
	}
	return d
}

// run sends one batch and applies each Guard's outcome.
func (s *scheduler) run(sd send) {
	defer close(sd.b.done)
	defer sd.b.cancel()
	ctx := sd.b.ctx
	if sd.single {
		g := sd.gs[0]
		sent := time.Now()
		l, err := s.c.b.TryRenew(ctx, Lease{Key: g.key, Token: g.token, Owner: g.owner}, g.s.ttl)
		replied := time.Now()
		if mutantOn(mutantDeadlineFromReply) {
			sent = time.Now()
		}
		g.applyRenewal(sd.b, sent, replied, l, err, false)
		return
	}
	reqs := make([]RenewRequest, len(sd.gs))
	for i, g := range sd.gs {
		reqs[i] = RenewRequest{Lease: Lease{Key: g.key, Token: g.token, Owner: g.owner}, TTL: g.s.ttl}
	}
	sent := time.Now()
	res, err := s.br.TryRenewBatch(ctx, reqs)
	replied := time.Now()
	if mutantOn(mutantBatchDeadlineFromReply) {
		sent = time.Now()
	}
	if err == nil && len(res) != len(reqs) {
		err = errors.Join(ErrUnavailable, errors.New("sqllock: the backend's batch renewal returned a result count unlike its request count"))
	}
	if err != nil {
		s.c.log.Debug("sqllock: batch renewal failed, retrying each lease", "leases", len(reqs), "backend", s.c.opts.BackendName, "err", err)
	}
	for i, g := range sd.gs {
		if err != nil {
			g.applyRenewal(sd.b, sent, replied, Lease{}, err, false)
			continue
		}
		r := res[i]
		// A transient error of this element alone: renew it on its own.
		alone := r.Err != nil && !errors.Is(r.Err, ErrLeaseLost)
		g.applyRenewal(sd.b, sent, replied, r.Lease, r.Err, alone)
	}
}

// reschedule sets g's next renewal (and its local deadline, which never
// moves back) and clears its batch if b carried it. Called with g.mu held.
func (s *scheduler) reschedule(g *Guard, b *batch, due, local time.Time, alone bool) {
	s.mu.Lock()
	if g.slot.inFlight == b && b != nil {
		g.slot.inFlight = nil
		b.live--
	}
	if g.slot.expIdx >= 0 { // still live
		// A manual Renew (due zero) leaves the schedule alone.
		if !due.IsZero() {
			g.slot.due = due
			g.slot.alone = alone
			s.due.fix(g)
		}
		if local.After(g.slot.expAt) {
			g.slot.expAt = local
			s.exp.fix(g)
		}
		if g.capped(g.slot.expAt) {
			// The local deadline reached the max hold: no renewal can
			// extend it, so none is sent; the Guard ends at it.
			s.due.remove(g)
		}
		s.armLocked()
	}
	s.mu.Unlock()
}

// landed clears g's batch if b carried it. Called with g.mu held.
func (s *scheduler) landed(g *Guard, b *batch) {
	s.mu.Lock()
	if g.slot.inFlight == b && b != nil {
		g.slot.inFlight = nil
		b.live--
	}
	s.mu.Unlock()
}
