package sqlite

import (
	"container/list"
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/internal/wait"
	"github.com/ashlock/ashlock/sqllock"
)

// queryRow runs a statement that returns at most one row, scans it into
// dest, and reads on to the end: for an autocommit write with RETURNING,
// the step after the last row is the one that commits, so an error there
// is seen here and not lost in Close.
func (b *Backend) queryRow(ctx context.Context, o outcome.Op, query string, args []any, dest ...any) (found bool, err error) {
	stmt, err := b.stmt(ctx, query)
	if err != nil {
		return false, err
	}
	sctx, args, g, release := shield(ctx, o, args)
	defer release()
	rows, err := stmt.QueryContext(sctx, args...)
	if err != nil {
		return false, g.notSent(err)
	}
	defer rows.Close()
	for rows.Next() {
		if found {
			return true, fmt.Errorf("sqllock/sqlite: more than one row from %q", query)
		}
		if err := rows.Scan(dest...); err != nil {
			return false, err
		}
		found = true
	}
	if err := rows.Err(); err != nil {
		return false, err
	}
	return found, rows.Close()
}

// stmt returns query prepared on b.db. Statements are prepared on first use,
// not in New, because the application may create the table later; a failed
// prepare is not cached.
func (b *Backend) stmt(ctx context.Context, query string) (*sql.Stmt, error) {
	b.stmtMu.Lock()
	defer b.stmtMu.Unlock()
	if b.closed.Load() {
		return nil, errClosed
	}
	if s := b.stmts[query]; s != nil {
		return s, nil
	}
	s, err := b.db.PrepareContext(ctx, query)
	if err != nil {
		return nil, err
	}
	b.stmts[query] = s
	return s, nil
}

// shield returns the context and arguments to run one statement with, so
// that ctx bounds the wait for a connection (an application's busy pool)
// but never interrupts the statement once it runs: an interrupted write's
// outcome would be unknown, and a statement lasts at most the busy timeout
// plus one commit. database/sql converts the arguments with the connection
// in hand, right before it hands the statement to the driver; the first
// argument's conversion closes the gate. If ctx ends before that, the
// statement is not sent: the wait for a connection ends (database/sql
// reports the cancelled statement context, a prepared statement's usual
// case) or the conversion refuses (when ctx ends just as the connection
// comes), and notSent turns either into operation o's not-sent error
// (outcome's) with ctx's cause. args[0] is the statement's key (or
// prefix), which the error names. Call release when the statement's rows
// are closed.
func shield(ctx context.Context, o outcome.Op, args []any) (sctx context.Context, gated []any, g *gate, release func()) {
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, cancel)
	key, _ := args[0].(string)
	g = &gate{ctx: ctx, stop: stop, o: o, key: key}
	gated = append([]any{gatedArg{v: args[0], g: g}}, args[1:]...)
	return sctx, gated, g, func() { stop(); cancel() }
}

// gate is shut by the first conversion of its statement's arguments.
type gate struct {
	ctx  context.Context
	o    outcome.Op
	key  string
	stop func() bool
	once sync.Once
	shut atomic.Bool // the caller's context can no longer cancel the statement
}

// notSent returns err, or the operation's not-sent error when err came
// before the statement reached the driver and the caller's context had
// ended.
func (g *gate) notSent(err error) error {
	if err != nil && !g.shut.Load() && g.ctx.Err() != nil {
		return lite.NotSent(g.o, g.key, true, context.Cause(g.ctx))
	}
	return err
}

// gatedArg is a statement argument whose conversion shuts its gate.
type gatedArg struct {
	v any
	g *gate
}

// Value implements [driver.Valuer]. database/sql may convert the arguments
// more than once (a retry on a bad connection): the first call decides.
func (a gatedArg) Value() (driver.Value, error) {
	a.g.once.Do(func() { a.g.shut.Store(a.g.stop()) })
	if !a.g.shut.Load() {
		return nil, lite.NotSent(a.g.o, a.g.key, true, context.Cause(a.g.ctx))
	}
	return driver.DefaultParameterConverter.ConvertValue(a.v)
}

// ttlMillis rounds ttl up to whole milliseconds.
func ttlMillis(ttl time.Duration) int64 {
	return int64((ttl + time.Millisecond - 1) / time.Millisecond)
}

// leaseMillis is what a statement adds to its now for a lease of ttl: ttl
// in whole milliseconds, rounded up, and one more. SQLite's clock reads
// whole milliseconds, truncated, so a statement's now may be up to 1 ms
// before the instant it was read; with the extra millisecond a deadline is
// always later than (that instant + ttl), and so later than the holder's
// send time + ttl, whatever margin the client uses. (Without it a second
// client was granted the key before the first's local deadline in 7 of
// 300 rounds at TTL 20 ms and a 200µs margin.)
func leaseMillis(ttl time.Duration) int64 { return ttlMillis(ttl) + 1 }

// remaining is how long a lease with deadline has left at least, by a
// clock that read now: the instant now stands for may be up to 1 ms later
// (see leaseMillis), so one millisecond less, and never below zero. It is
// never more than the lease's TTL.
func remaining(deadline, now int64) time.Duration {
	return time.Duration(max(deadline-now-1, 0)) * time.Millisecond
}

// minHoldMillis is a min hold in milliseconds, rounded up (0 for none).
func minHoldMillis(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return leaseMillis(d)
}

// nonEmpty is v, or nil when v holds no byte: no value is nil everywhere.
func nonEmpty(v []byte) []byte {
	if len(v) == 0 {
		return nil
	}
	return v
}

// keyState is the key's row (found, token, held, deadline, owner) at now.
func keyState(found bool, token int64, held bool, deadline, now int64, owner string) sqllock.KeyState {
	return sqllock.KeyState{Found: found, Token: token, Held: held, Expired: deadline <= now, Owner: owner}
}

// lite names SQLite's errors in the dialects' one vocabulary of outcomes.
const lite = outcome.Dialect("sqllock/sqlite")

// write runs op, one attempt of an operation that writes, holding the
// Backend's write slot, retrying while the database is busy. Renewals
// (o == outcome.Renew: TryRenew and TryRenewBatch) take the slot before
// any waiting acquire or release, so that a flood of acquires cannot make
// held leases expire; see writeSlot for why acquires still progress. A
// context that ends while the operation waits for the slot yields the
// not-sent error, as before.
func (b *Backend) write(ctx context.Context, o outcome.Op, key string, op func(context.Context) error) error {
	if b.closed.Load() {
		return errClosed
	}
	if ctx.Err() != nil {
		return lite.NotSent(o, key, true, context.Cause(ctx))
	}
	renewal := o == outcome.Renew
	if !b.writeSlot.take(ctx, renewal) {
		return lite.NotSent(o, key, true, context.Cause(ctx))
	}
	defer b.writeSlot.give()
	return b.retry(ctx, b.retryTimeout, op)
}

// maxRenewRun is how many renewals in a row may take the write slot while
// an acquire or release waits; then the oldest of those goes first.
const maxRenewRun = 8

// writeSlot lets one write statement run at a time per Backend. Waiters
// queue in two first-come-first-served lines, renewals and the others
// (acquires, releases); when the holder gives the slot up it hands it to
// the oldest waiting renewal, unless maxRenewRun renewals have taken it in
// a row while another waited: then to the oldest other. So while an
// acquire or a release waits, at most maxRenewRun renewals take the slot
// between two others: it waits for the others queued before it and at most
// maxRenewRun renewals per other, and never starves.
// (Renewals are few anyway: one per held lease per renewal interval, and
// the client batches them.) A hand-off happens under mu, so the slot has
// exactly one holder or none; a waiter whose context ends after being
// handed the slot gives it on. The zero value is a free slot.
type writeSlot struct {
	mu       sync.Mutex
	held     bool
	renewals list.List // of *slotWaiter
	others   list.List // of *slotWaiter
	run      int       // renewals in a row handed the slot while others waited
}

// slotWaiter is one goroutine waiting for the write slot.
type slotWaiter struct {
	granted chan struct{} // closed when the slot is handed over
	elem    *list.Element // in its line until then
	line    *list.List
}

// take waits for the slot and reports whether the caller holds it; false
// when ctx ended first (the caller then does not hold it).
func (s *writeSlot) take(ctx context.Context, renewal bool) bool {
	s.mu.Lock()
	if !s.held {
		s.held = true
		s.mu.Unlock()
		return true
	}
	w := &slotWaiter{granted: make(chan struct{}), line: &s.others}
	if renewal {
		w.line = &s.renewals
	}
	w.elem = w.line.PushBack(w)
	s.mu.Unlock()
	select {
	case <-w.granted:
		return true
	case <-ctx.Done():
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if w.elem == nil { // handed the slot as ctx ended: give it on
		s.handOff()
		return false
	}
	w.line.Remove(w.elem)
	return false
}

// give releases the slot the caller holds.
func (s *writeSlot) give() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.handOff()
}

// handOff passes the held slot to the next waiter, or frees it. s.mu is
// held.
func (s *writeSlot) handOff() {
	line := &s.others
	switch {
	case s.renewals.Len() > 0 && (s.others.Len() == 0 || s.run < maxRenewRun):
		line = &s.renewals
		s.run++
		if s.others.Len() == 0 {
			s.run = 0
		}
	case s.others.Len() > 0:
		s.run = 0
	default:
		s.held, s.run = false, 0
		return
	}
	w := line.Remove(line.Front()).(*slotWaiter)
	w.elem = nil
	close(w.granted)
}

// read runs op, a read-only attempt, retrying while the database is busy.
func (b *Backend) read(ctx context.Context, o outcome.Op, key string, op func(context.Context) error) error {
	if b.closed.Load() {
		return errClosed
	}
	if ctx.Err() != nil {
		return lite.NotSent(o, key, true, context.Cause(ctx))
	}
	return b.retry(ctx, b.retryTimeout, op)
}

// errRetry asks retry to run an attempt again at once: the row moved
// between two statements of one operation.
var errRetry = errors.New("sqllock/sqlite: row changed between statements")

// busyError is the error after the retry budget or the caller's context
// ran out while the database stayed busy. It matches
// [sqllock.ErrUnavailable] and, when the context ended, the context's error.
type busyError struct {
	attempts int
	waited   time.Duration
	last     error // the driver's last error
	ctxErr   error
}

func (e *busyError) Error() string {
	s := fmt.Sprintf("sqllock/sqlite: database busy: %d attempts in %v, not applied", e.attempts, e.waited.Round(time.Millisecond))
	if e.ctxErr != nil {
		s += " (" + e.ctxErr.Error() + ")"
	}
	return s + ": " + e.last.Error()
}

func (e *busyError) Is(target error) bool { return target == sqllock.ErrUnavailable }

func (e *busyError) Unwrap() error { return e.ctxErr }

// maxRowChanges bounds the errRetry loop; the row cannot keep moving back.
const maxRowChanges = 10

// retry runs op until it returns something other than a busy error, for
// at most budget, sleeping with full jitter in between. op gets ctx: its
// statements shield themselves from it once they run (see shield); ctx is
// also checked between attempts.
func (b *Backend) retry(ctx context.Context, budget time.Duration, op func(context.Context) error) error {
	start := time.Now()
	changes := 0
	for attempt := 1; ; attempt++ {
		err := op(ctx)
		if errors.Is(err, errRetry) && changes < maxRowChanges {
			changes++
			continue
		}
		if err == nil || !isBusy(err) {
			return err
		}
		b.busyRetries.Add(1)
		waited := time.Since(start)
		if waited >= budget {
			return &busyError{attempts: attempt, waited: waited, last: err}
		}
		// Full jitter over an exponential cap: 1, 2, 4 ... 32 ms.
		limit := time.Millisecond << min(attempt-1, 5)
		if wait.Sleep(ctx, rand.N(limit)+100*time.Microsecond) != nil {
			return &busyError{attempts: attempt, waited: time.Since(start), last: err, ctxErr: ctx.Err()}
		}
	}
}
