// Package election is leader election on a [sqllock.Client]: one leader at
// a time among the candidates that campaign for a name, on any backend.
//
// A term is one lease of the election's key, and its number is the lease's
// fencing token: strictly greater than every earlier term's, so a leader
// passes it to what it writes and a resource can refuse a deposed leader.
//
//	e, err := election.New(client, election.Config{Name: "billing-scheduler"})
//	err = e.Run(ctx, func(ctx context.Context, t election.Term) error {
//		// lead until ctx ends; fence writes with t.Token
//	})
//
// The edges other electors have, and how this one avoids them:
//   - [Election.Run] does not return because leadership was lost: it
//     campaigns again (after a short backoff) until its context ends, or
//     until the leader's function returns while it still leads.
//   - The leader's context ends at the first sign of a lost lease, and at
//     the guard's local deadline at the latest (G3): no one leads past it.
//     A transient backend error is not a loss; the guard's rules decide.
//   - The lease is released only after the leader's function has returned
//     (in Run) or when [Leadership.Resign] is called: ending a context never
//     releases leadership under code that still runs.
//   - There are no callbacks: the function is called once per term, in
//     order, never concurrently; nothing reports the end of a term that did
//     not start.
//   - [Election.Observe] reports "no leader" too, never a term lower
//     than one it reported, and never an ended term as led again.
package election

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ashlock/ashlock/internal/wait"
	"github.com/ashlock/ashlock/sqllock"
)

// KeyPrefix is prepended to an election's name to form its lock key.
const KeyPrefix = "election/"

// ErrNoLeader is matched by the error of [Election.Leader] when no
// candidate leads (a [*NoLeaderError]).
var ErrNoLeader = errors.New("election: no leader")

// NoLeaderError is [Election.Leader]'s error when no candidate leads. It
// matches [ErrNoLeader].
type NoLeaderError struct {
	Name     string
	LastTerm int64 // the last term's number; 0 when there was none
}

func (e *NoLeaderError) Error() string {
	return fmt.Sprintf("election: no leader for %q (last term %d)", e.Name, e.LastTerm)
}

// Is makes a NoLeaderError match [ErrNoLeader].
func (e *NoLeaderError) Is(target error) bool { return target == ErrNoLeader }

// Config configures an [Election]. Only Name is required.
type Config struct {
	// Name names the election: candidates of one name compete. The lock
	// key is KeyPrefix + Name and must be a valid key.
	Name string
	// TTL is each term's lease TTL; zero means the Client's.
	TTL time.Duration
	// Backoff is the pause before campaigning again after the attempt-th
	// lost term or failed campaign in a row; nil means
	// [sqllock.DefaultBackoff].
	Backoff func(attempt int) time.Duration
	// PollInterval is how often Observe reads the current term when no
	// release signal wakes it; zero means one second.
	PollInterval time.Duration
	// Value is what this candidate publishes with each term it wins (its
	// address, its version): at most [sqllock.MaxValueLen] bytes, stored
	// with the lease and shown to Leader, Observe and `sqllock leader`.
	Value []byte
}

// Term is one leader's tenure.
type Term struct {
	Name string
	// Token is the term's number: the lease's fencing token.
	Token int64
	// Leader is the lease's owner (the Client's owner name, a per-Client
	// random part and a sequence number).
	Leader string
	// Deadline is the lease's deadline by the database clock, as last read.
	Deadline time.Time
	// Value is the leader's [Config.Value] (nil for none).
	Value []byte
}

// Election campaigns for one name. It is safe for concurrent use, but one
// process normally calls Run once.
type Election struct {
	c   *sqllock.Client
	cfg Config
	key string
}

// New returns an Election for cfg on c. It validates cfg before any I/O.
func New(c *sqllock.Client, cfg Config) (*Election, error) {
	if c == nil {
		return nil, errors.New("election: New: nil Client")
	}
	if cfg.Name == "" {
		return nil, fmt.Errorf("%w: election: empty Name", sqllock.ErrInvalidKey)
	}
	key := KeyPrefix + cfg.Name
	if err := sqllock.ValidateKey(key); err != nil {
		return nil, fmt.Errorf("election: Name: %w", err)
	}
	if cfg.TTL != 0 {
		if err := sqllock.ValidateTTL(cfg.TTL); err != nil {
			return nil, fmt.Errorf("election: TTL: %w", err)
		}
	}
	if err := sqllock.ValidateValue(cfg.Value); err != nil {
		return nil, fmt.Errorf("election: Value: %w", err)
	}
	cfg.Value = bytes.Clone(cfg.Value)
	if cfg.PollInterval < 0 {
		return nil, &sqllock.OptionError{Field: "election.Config.PollInterval", Value: cfg.PollInterval}
	}
	if cfg.Backoff == nil {
		cfg.Backoff = sqllock.DefaultBackoff
	}
	if cfg.PollInterval == 0 {
		cfg.PollInterval = time.Second
	}
	return &Election{c: c, cfg: cfg, key: key}, nil
}

// Key returns the election's lock key.
func (e *Election) Key() string { return e.key }

// Leadership is a term this process holds.
type Leadership struct {
	g      *sqllock.Guard
	term   Term
	cancel context.CancelFunc // ends the guard's parent, after the release
}

// Term returns the term.
func (l *Leadership) Term() Term { return l.term }

// Context is cancelled when the leadership ends: the lease was lost (or its
// local deadline passed without a renewal), or Resign was called. It does
// not end with the context passed to Campaign.
func (l *Leadership) Context() context.Context { return l.g.Context() }

// LocalDeadline returns the term's local deadline: the monotonic instant
// at which the leadership ends unless a renewal succeeds first (see
// [sqllock.Guard.LocalDeadline]).
func (l *Leadership) LocalDeadline() time.Time { return l.g.LocalDeadline() }

// Done is shorthand for l.Context().Done().
func (l *Leadership) Done() <-chan struct{} { return l.g.Done() }

// Err returns nil while leading, else why not: a [*sqllock.LostError], or
// [sqllock.ErrReleased] after Resign.
func (l *Leadership) Err() error { return l.g.Err() }

// Resign ends the term and releases the lease, bounded by ctx as
// [sqllock.Guard.Release] is. It returns an error matching
// [sqllock.ErrLeaseLost] if the term had already been lost. Call it once
// the leader's work has stopped.
func (l *Leadership) Resign(ctx context.Context) error {
	err := l.g.Release(ctx)
	l.cancel()
	return err
}

// Campaign blocks until this process leads, or ctx ends (then it returns
// ctx's error). ctx bounds the campaign only: the leadership lives until it
// is lost or resigned, so that no release happens under code that still
// runs; call [Leadership.Resign] when done.
func (e *Election) Campaign(ctx context.Context) (*Leadership, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	parent, cancel := context.WithCancel(context.WithoutCancel(ctx))
	stop := context.AfterFunc(ctx, cancel)
	var (
		g   *sqllock.Guard
		err error
	)
	for {
		g, err = e.c.Acquire(parent, e.key, &sqllock.AcquireOptions{TTL: e.cfg.TTL, Value: e.cfg.Value, Wait: sqllock.WaitForever})
		// A grant whose reply came after its local deadline is of no use
		// and the Client has released it (a *LostError): that is a
		// campaign to run again, not a reason to stop campaigning.
		if err == nil || !errors.Is(err, sqllock.ErrLeaseLost) || parent.Err() != nil {
			break
		}
	}
	if !stop() {
		// ctx ended during the campaign (and cancelled parent): a grant
		// that came just before is not handed out.
		if err == nil {
			_ = g.Release(ctx) // ctx has ended: bounded by the Client's ReleaseTimeout
		}
		cancel()
		return nil, ctx.Err()
	}
	if err != nil {
		cancel()
		return nil, err
	}
	l := g.Lease()
	return &Leadership{g: g, cancel: cancel, term: Term{Name: e.cfg.Name, Token: l.Token, Leader: l.Owner, Deadline: l.Deadline, Value: l.Value}}, nil
}

// Run campaigns and calls fn with each term this process wins, one at a
// time, until ctx ends (then it returns ctx's error). fn's context ends
// when the term is lost or ctx ends; fn should return then. After fn
// returns, the lease is released; if the term had been lost, Run campaigns
// again after a backoff. If fn returns while the term is still held and
// ctx has not ended, Run releases the lease and returns fn's error (nil
// included), joined with the release's error if the release found the
// term lost. A panic in fn releases the lease and panics again. Run
// returns at once an error that campaigning again cannot mend (invalid
// input, a missing table, a closed Client).
func (e *Election) Run(ctx context.Context, fn func(ctx context.Context, t Term) error) error {
	failures := 0
	for {
		l, err := e.Campaign(ctx)
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			if !transient(err) {
				return err
			}
			failures++
			if e.sleep(ctx, failures) != nil {
				return ctx.Err()
			}
			continue
		}
		lost, ferr, rerr := e.lead(ctx, l, fn)
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case lost && mutantOn(mutantRunReturnsOnLoss):
			return errors.Join(ferr, rerr)
		case lost:
			failures++
			if e.sleep(ctx, failures) != nil {
				return ctx.Err()
			}
		case errors.Is(rerr, sqllock.ErrLeaseLost):
			return errors.Join(ferr, rerr)
		default:
			return ferr
		}
	}
}

// lead runs fn for the term l, then resigns. lost reports whether the term
// had ended (by a loss) before fn returned.
func (e *Election) lead(ctx context.Context, l *Leadership, fn func(context.Context, Term) error) (lost bool, ferr, rerr error) {
	parent := l.Context()
	if mutantOn(mutantLeadPastDeadline) {
		parent = ctx
	}
	fctx, fcancel := context.WithCancelCause(parent)
	stop := context.AfterFunc(ctx, func() { fcancel(context.Cause(ctx)) })
	defer func() {
		// After fn has returned (or panicked): never release under it.
		stop()
		fcancel(nil)
		lost = l.Err() != nil
		rerr = l.Resign(context.WithoutCancel(ctx))
	}()
	return false, fn(fctx, l.Term()), nil
}

func (e *Election) sleep(ctx context.Context, attempt int) error {
	return wait.Sleep(ctx, e.cfg.Backoff(attempt))
}

// transient reports whether campaigning again may succeed after err.
func transient(err error) bool {
	return errors.Is(err, sqllock.ErrUnavailable) || errors.Is(err, sqllock.ErrIndeterminate) ||
		errors.Is(err, sqllock.ErrNotAcquired)
}

// Leader returns the current term, or a [*NoLeaderError] (matching
// [ErrNoLeader]) when no lease of the election is held now.
func (e *Election) Leader(ctx context.Context) (Term, error) {
	o, err := e.observe(ctx)
	if err != nil {
		return Term{}, err
	}
	if !o.Leading {
		return Term{}, &NoLeaderError{Name: e.cfg.Name, LastTerm: o.Term.Token}
	}
	return o.Term, nil
}

// Observation is what Observe saw.
type Observation struct {
	// Leading is true while a leader holds Term.
	Leading bool
	// Term is the current term when Leading, else the last one (Token 0
	// if there was none).
	Term Term
}

func (e *Election) observe(ctx context.Context) (Observation, error) {
	infos, err := e.c.List(ctx, e.key)
	if err != nil {
		return Observation{}, err
	}
	for _, i := range infos {
		if i.Key == e.key {
			return Observation{Leading: i.Held, Term: Term{Name: e.cfg.Name, Token: i.Token, Leader: i.Owner, Deadline: i.Deadline, Value: i.Value}}, nil
		}
	}
	return Observation{Term: Term{Name: e.cfg.Name}}, nil
}

// Observe reports the election's state on the returned channel, in order,
// each time it changes (a new term, or leader / no leader), starting with
// the state now. It reads the state when the backend signals a release of
// the key and every PollInterval, and never reports a term lower than one it
// has reported, nor a term as led again once it reported that term ended.
// Read errors are not reported; the next read tries again. The channel is
// closed when ctx ends.
func (e *Election) Observe(ctx context.Context) <-chan Observation {
	out := make(chan Observation)
	wake, stopWatch, _ := e.c.Watch(e.key)
	go func() {
		defer close(out)
		defer stopWatch()
		t := time.NewTimer(0)
		defer t.Stop()
		var last Observation
		sent := false
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			case <-wake:
				if !t.Stop() {
					select {
					case <-t.C:
					default:
					}
				}
			}
			t.Reset(e.cfg.PollInterval)
			o, err := e.observe(ctx)
			if err != nil || o.Term.Token < last.Term.Token {
				continue
			}
			if o.Leading && !last.Leading && o.Term.Token == last.Term.Token && o.Term.Token > 0 {
				// A term reported ended does not come back: this read is
				// stale (a lagging replica), or the database clock stepped
				// back over the term's deadline after its leader stopped.
				continue
			}
			if sent && o.Leading == last.Leading && o.Term.Token == last.Term.Token && o.Term.Leader == last.Term.Leader {
				continue
			}
			select {
			case out <- o:
				last, sent = o, true
			case <-ctx.Done():
				return
			}
		}
	}()
	return out
}
