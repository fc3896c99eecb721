package cli

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// progressEvery is how often `run --wait` repeats who holds the key while
// nothing changes.
const progressEvery = 3 * time.Second

// progressf prints a line about a wait in progress (stderr, or a log record
// at INFO), unless --quiet.
func (e *env) progressf(format string, args ...any) {
	if e.quiet {
		return
	}
	e.notef(slog.LevelInfo, format, args...)
}

// waitReporter turns the acquire attempts of a wait into progress lines:
// at the first attempt refused, whenever the holder (its owner or token)
// changes, and every progressEvery in between.
type waitReporter struct {
	now   func() time.Time
	print func(format string, args ...any)

	mu          sync.Mutex
	last        time.Time // when a line was printed; zero before the first
	owner       string
	token       int64
	lastOutcome sqllock.Outcome
}

func (r *waitReporter) attempt(ev sqllock.AcquireAttemptEvent) {
	var he *sqllock.HeldError
	held := errors.As(ev.Err, &he)
	if !held && ev.Outcome != sqllock.OutcomeUnavailable && ev.Outcome != sqllock.OutcomeIndeterminate {
		return // granted, or the wait ends now: its own message says so
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	changed := r.last.IsZero() || ev.Outcome != r.lastOutcome ||
		(held && (he.Owner != r.owner || he.Token != r.token))
	if !changed && now.Sub(r.last) < progressEvery {
		return
	}
	r.last, r.lastOutcome = now, ev.Outcome
	if !held {
		r.owner, r.token = "", 0
		r.print("sqllock run: waiting for %q: the database did not answer (%s); trying again", ev.Key, stripPrefixes(errText(ev.Err)))
		return
	}
	r.owner, r.token = he.Owner, he.Token
	if he.Owner == "" {
		r.print("sqllock run: waiting for %q: it is held", ev.Key)
		return
	}
	r.print("sqllock run: waiting for %q: held by %q (token %d) for %v more", ev.Key, he.Owner, he.Token, he.Remaining.Round(100*time.Millisecond))
}

func errText(err error) string {
	if err == nil {
		return "no error"
	}
	return err.Error()
}

// withWaitProgress adds the progress lines of a wait to opts' Observer,
// keeping what it observed already.
func (e *env) withWaitProgress(opts sqllock.Options) sqllock.Options {
	if !e.waitProgress || e.quiet {
		return opts
	}
	r := &waitReporter{now: time.Now, print: e.progressf}
	prev := opts.Observer
	o := &sqllock.Observer{}
	if prev != nil {
		*o = *prev
	}
	o.AcquireAttempt = func(ctx context.Context, ev sqllock.AcquireAttemptEvent) {
		if prev != nil && prev.AcquireAttempt != nil {
			prev.AcquireAttempt(ctx, ev)
		}
		r.attempt(ev)
	}
	opts.Observer = o
	return opts
}
