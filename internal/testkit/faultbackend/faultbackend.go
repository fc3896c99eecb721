// Package faultbackend wraps a [sqllock.Backend] and injects faults, seeded:
// fail before the call (not applied), fail after it was applied (the reply
// is lost), delay, hang until the caller's context ends, and steps of the
// database clock. It counts every injected fault by kind and, given a
// [history.Recorder], records every call as the client saw it and every
// application as the backend did it (the audit log).
//
// One [DB] stands for one database; each client gets its own [Backend] from
// [DB.Client]. A call's fault is drawn from a seeded RNG keyed by the seed,
// the client and the call's identity (operation, key, owner without its
// random part, token, and how
// many such calls came before): the draws do not depend on how the calls
// of a client's goroutines (caller and watchdog) interleave, only on which
// calls are made, so that a goroutine woken at the same fake instant as
// another cannot shift every later draw (internal/testkit/sim relies on this).
package faultbackend

import (
	"context"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ashlock/ashlock/internal/testkit/history"
	"github.com/ashlock/ashlock/sqllock"
)

// Kind names a fault.
type Kind string

// The faults.
const (
	// FailBefore fails the call before it reaches the backend: not
	// applied, ErrUnavailable.
	FailBefore Kind = "fail_before"
	// FailAfter applies the call and loses the reply: ErrIndeterminate for
	// acquire and release, ErrUnavailable for renew.
	FailAfter Kind = "fail_after"
	// Delay delays the request before the backend applies it and the
	// reply after; if the caller's context ends meanwhile the caller gets
	// the lost-reply error and the request still lands later.
	Delay Kind = "delay"
	// Hang blocks until the caller's context ends, then applies the call
	// or not (half each), and loses the reply.
	Hang Kind = "hang"
	// ClockJump steps the database clock ([DB.StepClock]).
	ClockJump Kind = "clock_jump"
	// Busy fails one element of a batch renewal that is otherwise
	// applied: its row was locked and skipped (as PostgreSQL's batch
	// renewal does), a transient error of that element alone. It is drawn
	// per element, only for batches that get no other fault.
	Busy Kind = "busy"
)

// CallKinds are the per-call faults, in draw order.
var CallKinds = []Kind{FailBefore, FailAfter, Delay, Hang}

// Clock is a database clock that the test can step: base() + offset. Give
// its Now to memory.NewWithClock.
type Clock struct {
	base func() time.Time

	mu  sync.Mutex // guards off
	off time.Duration
}

// NewClock returns a clock that reads base (time.Now if nil) plus an offset.
func NewClock(base func() time.Time) *Clock {
	if base == nil {
		base = time.Now
	}
	return &Clock{base: base}
}

// Now is the database's now.
func (c *Clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.base().Add(c.off)
}

// Offset is the sum of the steps so far.
func (c *Clock) Offset() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.off
}

func (c *Clock) step(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.off += d
}

// DBOptions configure a [DB].
type DBOptions struct {
	// Clock is the inner backend's clock, if the test controls it.
	Clock *Clock
	// Recorder receives calls, faults and (with Audit) applications.
	Recorder *history.Recorder
	// Audit serialises applications under one lock and records each one in
	// that order: the audit log of a backend that keeps none (memory).
	// Only for backends whose calls do not block (memory).
	Audit bool
}

// DB is the shared side of the wrappers: the inner backend, its clock,
// the audit order and the fault counters. It is safe for concurrent use.
type DB struct {
	inner sqllock.Backend
	opts  DBOptions
	rec   *history.Recorder

	mu sync.Mutex // serialises applications when opts.Audit, and clock steps

	cmu    sync.Mutex // guards counts
	counts map[Kind]int64

	late sync.WaitGroup // requests that land after their caller gave up
}

// NewDB wraps inner.
func NewDB(inner sqllock.Backend, opts DBOptions) *DB {
	return &DB{inner: inner, opts: opts, rec: opts.Recorder, counts: map[Kind]int64{}}
}

// Inner returns the wrapped backend.
func (db *DB) Inner() sqllock.Backend { return db.inner }

func (db *DB) count(k Kind) {
	db.cmu.Lock()
	defer db.cmu.Unlock()
	db.counts[k]++
}

// Counts returns the faults injected so far, by kind.
func (db *DB) Counts() map[Kind]int64 {
	db.cmu.Lock()
	defer db.cmu.Unlock()
	out := make(map[Kind]int64, len(db.counts))
	for k, v := range db.counts {
		out[k] = v
	}
	return out
}

// FormatCounts renders counts as "{a:1, b:2}" in a fixed order, including
// the kinds in want that are 0.
func FormatCounts(counts map[Kind]int64, want ...Kind) string {
	m := map[string]int64{}
	for _, k := range want {
		m[string(k)] = 0
	}
	for k, v := range counts {
		m[string(k)] = v
	}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s:%d", k, m[k])
	}
	return "{" + strings.Join(parts, ", ") + "}"
}

// StepClock steps the database clock by d (atomically with respect to the
// applications) and counts a ClockJump.
func (db *DB) StepClock(d time.Duration) {
	if db.opts.Clock == nil {
		panic("faultbackend: StepClock without a Clock")
	}
	db.mu.Lock()
	db.opts.Clock.step(d)
	db.mu.Unlock()
	db.count(ClockJump)
	if db.rec != nil {
		db.rec.Event(history.Event{Kind: history.EvClockJump, At: db.rec.Now(), D: d})
		db.rec.Fault(history.Fault{Client: -1, Kind: string(ClockJump), At: db.rec.Now()})
	}
}

// Expire forces key's lease to expire now, as an operator would (`sqllock
// release --force`); the inner backend must have an Expire(key) method
// (memory has).
func (db *DB) Expire(key string) {
	ex, ok := db.inner.(interface{ Expire(string) })
	if !ok {
		panic("faultbackend: inner backend has no Expire")
	}
	db.mu.Lock()
	defer db.mu.Unlock()
	var now time.Time
	if db.opts.Clock != nil {
		now = db.opts.Clock.Now()
	}
	ex.Expire(key)
	if db.rec != nil {
		at := db.rec.Now()
		db.rec.Event(history.Event{Kind: history.EvExpire, Key: key, At: at})
		if db.opts.Audit {
			db.rec.Apply(history.Audit{Kind: history.Expire, Key: key, DBNow: now.UnixNano(), Deadline: now.UnixNano(), At: at})
		}
	}
}

// Wait waits for the delayed requests still in flight to land.
func (db *DB) Wait() { db.late.Wait() }

// Config configures one client's wrapper.
type Config struct {
	// Client identifies the client in the history.
	Client int
	// Seed seeds the wrapper's RNG (with Client).
	Seed uint64
	// Prob is the probability that a call gets each fault; missing kinds
	// never fire. Their sum must be at most 1.
	Prob map[Kind]float64
	// MaxDelay bounds each half (before and after applying) of a Delay.
	MaxDelay time.Duration
	// Spread, when set, keeps the clients of a simulation from acting at
	// the same fake instant (which would make the order of their requests
	// up to the scheduler): a release wake-up reaches a client after its
	// own delay in [Spread, 2·Spread), and the remaining time of a held
	// lease reported to it is that much longer. Both only delay a waiter.
	Spread time.Duration
	// MaxHangRun, when set, bounds how many of the client's calls in a
	// row may hang: the call after that many hung ones is answered (a
	// pool has that many half-open connections; each caller that gives
	// up on one discards it, and the next call gets a working one).
	MaxHangRun int
}

// Backend is one client's fault-injecting wrapper. It is safe for
// concurrent use.
type Backend struct {
	db  *DB
	cfg Config

	mu      sync.Mutex // guards prob, seen and hangRun
	seen    map[string]uint64
	hangRun int // calls in a row that hung (MaxHangRun)

	dead   atomic.Bool
	paused atomic.Bool
}

var (
	_ sqllock.Backend      = (*Backend)(nil)
	_ sqllock.Watcher      = (*Backend)(nil)
	_ sqllock.BatchRenewer = (*Backend)(nil)
)

// Client returns a wrapper for one client.
func (db *DB) Client(cfg Config) *Backend {
	prob := make(map[Kind]float64, len(cfg.Prob))
	for k, v := range cfg.Prob {
		prob[k] = v
	}
	cfg.Prob = prob
	return &Backend{db: db, cfg: cfg, seen: map[string]uint64{}}
}

// SetProb changes the probability of one fault kind from now on.
func (b *Backend) SetProb(k Kind, p float64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.cfg.Prob[k] = p
}

// Kill crashes the client: from now on none of its requests reaches the
// backend (also those in flight or delayed), and every call blocks until
// its context ends. It models a process that stopped: it never renews or
// releases again.
func (b *Backend) Kill() { b.dead.Store(true) }

// Pause stops (true) or resumes (false) the client as a whole-process
// pause would: while paused none of its requests reaches the backend and
// its calls block until their contexts end.
func (b *Backend) Pause(on bool) { b.paused.Store(on) }

func (b *Backend) down() bool { return b.dead.Load() || b.paused.Load() }

type draw struct {
	kind   Kind
	d1, d2 time.Duration
	apply  bool // for Hang
}

func (b *Backend) draw(op history.Op) draw {
	// The owner's random per-Client part is left out: a seed replays.
	return b.drawID(fmt.Sprintf("%s\x00%s\x00%s\x00%d", op.Kind, op.Key, history.NormalizeOwner(op.Owner), op.Token))
}

// drawID draws the fault of the call identified by id (see the package
// doc).
func (b *Backend) drawID(id string) draw {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := b.seen[id]
	b.seen[id] = n + 1
	h := fnv.New64a()
	h.Write([]byte(id))
	rng := rand.New(rand.NewPCG(b.cfg.Seed^(uint64(b.cfg.Client+1)*0x9e3779b97f4a7c15), h.Sum64()+n*0xbf58476d1ce4e5b9))
	u := rng.Float64()
	var dr draw
	if b.cfg.MaxDelay > 0 {
		dr.d1 = time.Duration(rng.Int64N(int64(b.cfg.MaxDelay)))
		dr.d2 = time.Duration(rng.Int64N(int64(b.cfg.MaxDelay)))
	}
	dr.apply = rng.IntN(2) == 0
	acc := 0.0
	for _, k := range CallKinds {
		acc += b.cfg.Prob[k]
		if u < acc {
			dr.kind = k
			break
		}
	}
	if b.cfg.MaxHangRun > 0 {
		switch {
		case dr.kind != Hang:
			b.hangRun = 0
		case b.hangRun >= b.cfg.MaxHangRun:
			dr.kind, b.hangRun = "", 0
		default:
			b.hangRun++
		}
	}
	return dr
}

// lostReply is the error a caller gets when it cannot know whether its
// request was applied.
func lostReply(kind history.OpKind, why string, cause error) error {
	e := sqllock.ErrIndeterminate
	if kind == history.Renew {
		e = sqllock.ErrUnavailable
	}
	if cause != nil {
		return fmt.Errorf("%w: %s: %w", e, why, cause)
	}
	return fmt.Errorf("%w: %s", e, why)
}

type applyFunc func(ctx context.Context) (sqllock.Lease, error)

// apply runs fn at the backend unless the client is dead, and records the
// application.
func (b *Backend) apply(ctx context.Context, op history.Op, id int, fn applyFunc) (sqllock.Lease, error, bool) {
	if b.down() {
		return sqllock.Lease{}, nil, false
	}
	db := b.db
	if db.opts.Audit {
		db.mu.Lock()
		defer db.mu.Unlock()
	}
	var now time.Time
	if db.opts.Clock != nil {
		now = db.opts.Clock.Now()
	}
	l, err := fn(ctx)
	if db.rec != nil && db.opts.Audit {
		out := history.Classify(err)
		if out == history.OK || out == history.Held || out == history.Lost || out == history.Exhausted {
			a := history.Audit{Kind: op.Kind, Key: op.Key, Owner: op.Owner, Token: op.Token, Outcome: out, TTL: op.TTL,
				DBNow: now.UnixNano(), At: db.rec.Now(), Op: id}
			if out == history.OK && op.Kind != history.Release {
				a.DBNow, a.Deadline = l.BackendTime.UnixNano(), l.Deadline.UnixNano()
				if op.Kind == history.Acquire {
					a.Token, a.Key = l.Token, l.Key // a permit's grant: its own key
				}
			}
			db.rec.Apply(a)
		}
	}
	return l, err, true
}

// call runs one backend call through the fault schedule.
func (b *Backend) call(ctx context.Context, op history.Op, fn applyFunc) (sqllock.Lease, error) {
	rec := b.db.rec
	op.Client = b.cfg.Client
	id := 0
	if rec != nil {
		op.Call = rec.Now()
		id = rec.BeginOp(op)
	}
	dr := b.draw(op)
	if b.down() {
		dr.kind = "dead"
	}
	if dr.kind != "" && dr.kind != "dead" {
		b.db.count(dr.kind)
		if rec != nil {
			rec.Fault(history.Fault{Client: b.cfg.Client, Kind: string(dr.kind), Op: op.Kind, Key: op.Key, At: rec.Now()})
		}
	}
	l, err := b.run(ctx, op, id, dr, fn)
	var he *sqllock.HeldError
	if b.cfg.Spread > 0 && errors.As(err, &he) {
		c := *he
		c.Remaining += b.spread()
		err = &c
	}
	if rec != nil {
		rec.EndOp(id, func(o *history.Op) {
			o.Return = rec.Now()
			o.Outcome = history.Classify(err)
			o.Fault = string(dr.kind)
			if err != nil {
				o.Err = err.Error()
			}
			if err == nil && op.Kind != history.Release {
				o.DBNow, o.Deadline = l.BackendTime.UnixNano(), l.Deadline.UnixNano()
				if op.Kind == history.Acquire {
					o.Token, o.Key = l.Token, l.Key // a permit's grant: its own key
				}
			}
		})
	}
	return l, err
}

func (b *Backend) run(ctx context.Context, op history.Op, id int, dr draw, fn applyFunc) (sqllock.Lease, error) {
	if err := ctx.Err(); err != nil {
		return sqllock.Lease{}, err // not sent
	}
	switch dr.kind {
	case "":
		l, err, ok := b.apply(ctx, op, id, fn)
		if !ok {
			<-ctx.Done()
			return sqllock.Lease{}, fmt.Errorf("%w: client is down: %w", sqllock.ErrUnavailable, ctx.Err())
		}
		return l, err
	case "dead":
		<-ctx.Done()
		return sqllock.Lease{}, fmt.Errorf("%w: client is down: %w", sqllock.ErrUnavailable, ctx.Err())
	case FailBefore:
		return sqllock.Lease{}, fmt.Errorf("%w: injected failure before the call", sqllock.ErrUnavailable)
	case FailAfter:
		b.apply(context.WithoutCancel(ctx), op, id, fn)
		return sqllock.Lease{}, lostReply(op.Kind, "injected: reply lost after the call was applied", nil)
	case Hang:
		<-ctx.Done()
		if dr.apply {
			b.apply(context.WithoutCancel(ctx), op, id, fn)
		}
		return sqllock.Lease{}, lostReply(op.Kind, "injected hang", ctx.Err())
	case Delay:
		start := time.Now()
		if !sleepCtx(ctx, dr.d1) {
			// The request is still on its way; it lands after d1.
			rest := dr.d1 - time.Since(start)
			b.db.late.Add(1)
			go func() {
				defer b.db.late.Done()
				time.Sleep(rest)
				b.apply(context.WithoutCancel(ctx), op, id, fn)
			}()
			return sqllock.Lease{}, lostReply(op.Kind, "injected delay", ctx.Err())
		}
		l, err, ok := b.apply(context.WithoutCancel(ctx), op, id, fn)
		if !ok {
			<-ctx.Done()
			return sqllock.Lease{}, fmt.Errorf("%w: client is down: %w", sqllock.ErrUnavailable, ctx.Err())
		}
		if !sleepCtx(ctx, dr.d2) {
			return sqllock.Lease{}, lostReply(op.Kind, "injected delay of the reply", ctx.Err())
		}
		return l, err
	}
	return sqllock.Lease{}, errors.New("faultbackend: unknown fault")
}

func sleepCtx(ctx context.Context, d time.Duration) bool {
	if d <= 0 {
		return ctx.Err() == nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

// TryAcquire implements [sqllock.Backend].
func (b *Backend) TryAcquire(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	if err := req.Validate(); err != nil {
		return sqllock.Lease{}, err
	}
	op := history.Op{Kind: history.Acquire, Key: req.Key, Owner: req.Owner, TTL: req.TTL}
	return b.call(ctx, op, func(ctx context.Context) (sqllock.Lease, error) { return b.db.inner.TryAcquire(ctx, req) })
}

// TryRenew implements [sqllock.Backend].
func (b *Backend) TryRenew(ctx context.Context, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
	if err := sqllock.ValidateLease(l); err != nil {
		return sqllock.Lease{}, err
	}
	if err := sqllock.ValidateTTL(ttl); err != nil {
		return sqllock.Lease{}, err
	}
	op := history.Op{Kind: history.Renew, Key: l.Key, Owner: l.Owner, Token: l.Token, TTL: ttl}
	return b.call(ctx, op, func(ctx context.Context) (sqllock.Lease, error) { return b.db.inner.TryRenew(ctx, l, ttl) })
}

// TryRenewBatch implements [sqllock.BatchRenewer]. Each element is recorded
// as a renew operation of its own, called and returned with the batch. The
// batch as a whole gets one fault, drawn from the identities of its
// elements: fail before (none applied), fail after (all applied, the reply
// lost: every element's outcome unknown), delay, or hang; a batch without
// one may have single elements fail as Busy. The inner backend's batch
// renewal applies the batch at one instant (a per-element TryRenew if it
// has none).
func (b *Backend) TryRenewBatch(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
	if err := sqllock.ValidateRenewBatch(reqs); err != nil {
		return nil, err
	}
	if len(reqs) == 0 {
		return nil, nil
	}
	rec := b.db.rec
	ops := make([]history.Op, len(reqs))
	ids := make([]int, len(reqs))
	parts := make([]string, len(reqs))
	for i, r := range reqs {
		ops[i] = history.Op{Kind: history.Renew, Key: r.Lease.Key, Owner: r.Lease.Owner, Token: r.Lease.Token, TTL: r.TTL, Client: b.cfg.Client}
		if rec != nil {
			ops[i].Call = rec.Now()
			ids[i] = rec.BeginOp(ops[i])
		}
		parts[i] = fmt.Sprintf("%s\x00%s\x00%d", r.Lease.Key, history.NormalizeOwner(r.Lease.Owner), r.Lease.Token)
	}
	sort.Strings(parts)
	dr := b.drawID("renew-batch\x00" + strings.Join(parts, "\x01"))
	if b.down() {
		dr.kind = "dead"
	}
	busy := make([]bool, len(reqs))
	if dr.kind == "" {
		for i, op := range ops {
			if b.drawBusy(op) {
				busy[i] = true
			}
		}
	}
	inject := func(k Kind, key string) {
		b.db.count(k)
		if rec != nil {
			rec.Fault(history.Fault{Client: b.cfg.Client, Kind: string(k), Op: history.Renew, Key: key, At: rec.Now()})
		}
	}
	if dr.kind != "" && dr.kind != "dead" {
		inject(dr.kind, "")
	}
	for i, bz := range busy {
		if bz {
			inject(Busy, ops[i].Key)
		}
	}
	res, err := b.runBatch(ctx, ops, ids, reqs, busy, dr)
	if rec != nil {
		for i := range ops {
			rec.EndOp(ids[i], func(o *history.Op) {
				o.Return = rec.Now()
				o.Fault = string(dr.kind)
				e := err
				if e == nil {
					e = res[i].Err
				}
				if e == nil && busy[i] {
					e = errBusy
				}
				o.Outcome = history.Classify(e)
				if e != nil {
					o.Err = e.Error()
				} else {
					o.DBNow, o.Deadline = res[i].Lease.BackendTime.UnixNano(), res[i].Lease.Deadline.UnixNano()
				}
				if busy[i] {
					o.Fault = string(Busy)
				}
			})
		}
	}
	return res, err
}

var errBusy = fmt.Errorf("%w: injected: row busy, not renewed in the batch", sqllock.ErrUnavailable)

// drawBusy draws whether op, an element of a batch renewal without a
// fault of its own, fails alone.
func (b *Backend) drawBusy(op history.Op) bool {
	b.mu.Lock()
	p := b.cfg.Prob[Busy]
	b.mu.Unlock()
	if p == 0 {
		return false
	}
	id := fmt.Sprintf("busy\x00%s\x00%s\x00%d", op.Key, history.NormalizeOwner(op.Owner), op.Token)
	b.mu.Lock()
	n := b.seen[id]
	b.seen[id] = n + 1
	b.mu.Unlock()
	h := fnv.New64a()
	h.Write([]byte(id))
	rng := rand.New(rand.NewPCG(b.cfg.Seed^(uint64(b.cfg.Client+1)*0x9e3779b97f4a7c15), h.Sum64()+n*0xbf58476d1ce4e5b9))
	return rng.Float64() < p
}

// applyBatch applies the elements of a batch renewal that are not busy at
// the backend, unless the client is down, and records each application.
func (b *Backend) applyBatch(ctx context.Context, ops []history.Op, ids []int, reqs []sqllock.RenewRequest, busy []bool) ([]sqllock.RenewResult, bool) {
	if b.down() {
		return nil, false
	}
	db := b.db
	if db.opts.Audit {
		db.mu.Lock()
		defer db.mu.Unlock()
	}
	var now time.Time
	if db.opts.Clock != nil {
		now = db.opts.Clock.Now()
	}
	var send []sqllock.RenewRequest
	var at []int
	for i, r := range reqs {
		if !busy[i] {
			send = append(send, r)
			at = append(at, i)
		}
	}
	out := make([]sqllock.RenewResult, len(reqs))
	for i := range out {
		if busy[i] {
			out[i].Err = errBusy
		}
	}
	var res []sqllock.RenewResult
	var err error
	if br, ok := db.inner.(sqllock.BatchRenewer); ok {
		res, err = br.TryRenewBatch(ctx, send)
	} else {
		res = make([]sqllock.RenewResult, len(send))
		for j, r := range send {
			res[j].Lease, res[j].Err = db.inner.TryRenew(ctx, r.Lease, r.TTL)
		}
	}
	if err != nil {
		for _, i := range at {
			out[i].Err = err
		}
		return out, true
	}
	for j, i := range at {
		out[i] = res[j]
	}
	if db.rec != nil && db.opts.Audit {
		for _, i := range at {
			op := ops[i]
			o := history.Classify(out[i].Err)
			if o != history.OK && o != history.Lost {
				continue
			}
			a := history.Audit{Kind: op.Kind, Key: op.Key, Owner: op.Owner, Token: op.Token, Outcome: o, TTL: op.TTL,
				DBNow: now.UnixNano(), At: db.rec.Now(), Op: ids[i]}
			if o == history.OK {
				a.DBNow, a.Deadline = out[i].Lease.BackendTime.UnixNano(), out[i].Lease.Deadline.UnixNano()
			}
			db.rec.Apply(a)
		}
	}
	return out, true
}

// runBatch is run for a batch renewal.
func (b *Backend) runBatch(ctx context.Context, ops []history.Op, ids []int, reqs []sqllock.RenewRequest, busy []bool, dr draw) ([]sqllock.RenewResult, error) {
	if err := ctx.Err(); err != nil {
		return nil, err // not sent
	}
	down := func() error {
		<-ctx.Done()
		return fmt.Errorf("%w: client is down: %w", sqllock.ErrUnavailable, ctx.Err())
	}
	apply := func(c context.Context) ([]sqllock.RenewResult, bool) { return b.applyBatch(c, ops, ids, reqs, busy) }
	switch dr.kind {
	case "":
		res, ok := apply(ctx)
		if !ok {
			return nil, down()
		}
		return res, nil
	case "dead":
		return nil, down()
	case FailBefore:
		return nil, fmt.Errorf("%w: injected failure before the batch", sqllock.ErrUnavailable)
	case FailAfter:
		apply(context.WithoutCancel(ctx))
		return nil, lostReply(history.Renew, "injected: batch reply lost after it was applied", nil)
	case Hang:
		<-ctx.Done()
		if dr.apply {
			apply(context.WithoutCancel(ctx))
		}
		return nil, lostReply(history.Renew, "injected hang of the batch", ctx.Err())
	case Delay:
		start := time.Now()
		if !sleepCtx(ctx, dr.d1) {
			rest := dr.d1 - time.Since(start)
			b.db.late.Add(1)
			go func() {
				defer b.db.late.Done()
				time.Sleep(rest)
				apply(context.WithoutCancel(ctx))
			}()
			return nil, lostReply(history.Renew, "injected delay of the batch", ctx.Err())
		}
		res, ok := apply(context.WithoutCancel(ctx))
		if !ok {
			return nil, down()
		}
		if !sleepCtx(ctx, dr.d2) {
			return nil, lostReply(history.Renew, "injected delay of the batch's reply", ctx.Err())
		}
		return res, nil
	}
	return nil, errors.New("faultbackend: unknown fault")
}

// Release implements [sqllock.Backend].
func (b *Backend) Release(ctx context.Context, l sqllock.Lease) error {
	if err := sqllock.ValidateLease(l); err != nil {
		return err
	}
	op := history.Op{Kind: history.Release, Key: l.Key, Owner: l.Owner, Token: l.Token}
	_, err := b.call(ctx, op, func(ctx context.Context) (sqllock.Lease, error) { return sqllock.Lease{}, b.db.inner.Release(ctx, l) })
	return err
}

// List implements [sqllock.Backend]; it injects no faults.
func (b *Backend) List(ctx context.Context, prefix string) ([]sqllock.LockInfo, error) {
	return b.db.inner.List(ctx, prefix)
}

// Watch implements [sqllock.Watcher] by forwarding to the inner backend;
// if it cannot watch, the channel never fires (the client polls).
func (b *Backend) Watch(key string) (<-chan struct{}, func()) {
	w, ok := b.db.inner.(sqllock.Watcher)
	if !ok {
		return make(chan struct{}), func() {}
	}
	in, stop := w.Watch(key)
	if b.cfg.Spread <= 0 {
		return in, stop
	}
	out, done, exited := make(chan struct{}, 1), make(chan struct{}), make(chan struct{})
	go func() {
		defer close(exited)
		for {
			select {
			case <-done:
				return
			case <-in:
			}
			t := time.NewTimer(b.spread())
			select {
			case <-done:
				t.Stop()
				return
			case <-t.C:
			}
			select {
			case out <- struct{}{}:
			default:
			}
		}
	}()
	return out, func() {
		stop()
		close(done)
		<-exited
	}
}

// spread is this client's delay in [Spread, 2·Spread), from a hash of the
// seed and the client, so that no sum of two clients' delays is likely to
// equal a third's.
func (b *Backend) spread() time.Duration { return SpreadDelay(b.cfg.Seed, b.cfg.Client, b.cfg.Spread) }

// SpreadDelay is the delay a client's wrapper adds with Config.Spread set
// (see Config.Spread): in [spread, 2·spread), from a hash of the seed and
// the client. Two clients with equal delays wake at the same instant after
// a release; a simulation that must never let them can choose client IDs
// whose delays differ.
func SpreadDelay(seed uint64, client int, spread time.Duration) time.Duration {
	h := fnv.New64a()
	fmt.Fprintf(h, "%d/%d", seed, client)
	return spread + time.Duration(h.Sum64()%uint64(spread))
}
