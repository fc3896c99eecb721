package cli

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// checkPermits checks run's --permits and --shared before any I/O: 0 (a
// lock) or a semaphore's limit, no --min-hold with either (a permit and a
// shared lease take none), and not both.
func (f *runFlags) checkPermits() error {
	if f.shared && f.permits != 0 {
		return fail(ExitUsage, "--shared does not apply to --permits: a permit is a lease of its own")
	}
	if f.shared && f.minHold > 0 {
		return fail(ExitUsage, "--min-hold does not apply to --shared: a shared lease takes no minimum hold")
	}
	if f.permits == 0 {
		return nil
	}
	if err := sqllock.ValidatePermits(f.permits); err != nil {
		return fail(ExitUsage, "--permits %d: must be from 1 to %d (0: a lock, not a semaphore)", f.permits, sqllock.MaxPermits)
	}
	if f.minHold > 0 {
		return fail(ExitUsage, "--min-hold does not apply to --permits: a permit takes no minimum hold")
	}
	return nil
}

// take is run's acquire call: the key, or with --permits one permit of
// it, one attempt or waiting as opts says.
func (f *runFlags) take(ctx context.Context, client *sqllock.Client, opts *sqllock.AcquireOptions) (*sqllock.Guard, error) {
	if f.shared {
		o := *opts
		o.Shared = true
		opts = &o
	}
	switch {
	case f.permits > 0:
		return client.AcquirePermit(ctx, f.key, f.permits, opts)
	case opts.Wait == 0:
		return client.TryAcquire(ctx, f.key, opts)
	}
	return client.Acquire(ctx, f.key, opts)
}

// permitsError is run's message for a permit acquire that was refused
// (every permit held) or asked for another limit; nil for any other
// error.
func permitsError(err error, f runFlags) error {
	var pe *sqllock.PermitsHeldError
	var le *sqllock.PermitLimitError
	switch {
	case errors.As(err, &le):
		return fail(ExitConfig, "semaphore %q has %d permits, not %d: its limit never changes (use another --key for another limit)", le.Key, le.Stored, le.Asked)
	case errors.As(err, &pe):
		msg := fmt.Sprintf("not acquired: the %d permits of %q are held", f.permits, f.key)
		if len(pe.Holders) > 0 {
			msg += fmt.Sprintf(", the soonest free in %v", pe.Remaining.Round(time.Millisecond))
		}
		if f.wait == 0 {
			msg += "; use --wait DURATION to wait for one"
		} else {
			msg += fmt.Sprintf("; gave up after waiting %v", f.wait)
		}
		return fail(f.conflictCode, "%s", msg)
	}
	return nil
}

// semaphore is what list shows of one semaphore: its limit, how many of
// its permits are held and the soonest end of one.
type semaphore struct {
	permits, held int
	soonest       time.Duration
}

// semaphores are the semaphores whose limit row is among infos, with the
// holders of their permits among infos.
func semaphores(infos []sqllock.LockInfo) map[string]*semaphore {
	sems := map[string]*semaphore{}
	for _, in := range infos {
		if sem, ok := sqllock.ParseLimitKey(in.Key); ok {
			sems[sem] = &semaphore{permits: int(in.Token)}
		}
	}
	for _, in := range infos {
		sem, i, ok := sqllock.ParsePermitKey(in.Key)
		s := sems[sem]
		if !ok || s == nil || i > s.permits || !in.Held {
			continue
		}
		if s.held == 0 || in.Remaining < s.soonest {
			s.soonest = in.Remaining
		}
		s.held++
	}
	return sems
}

// semaphoreLine is list's table line for a semaphore's limit row: the
// semaphore's key, how many permits are held of how many, and the time
// left to the soonest end of one; ok is false for any other row.
func semaphoreLine(in sqllock.LockInfo, sems map[string]*semaphore) (string, bool) {
	sem, ok := sqllock.ParseLimitKey(in.Key)
	s := sems[sem]
	if !ok || s == nil {
		return "", false
	}
	left := "-"
	if s.held > 0 {
		left = s.soonest.Round(time.Millisecond).String()
	}
	return fmt.Sprintf("%s\t%d/%d\tsemaphore\t-\t%s\t-\n", sem, s.held, s.permits, left), true
}

// semaphoreJSON adds to j, list --json's entry of in, the semaphore it
// describes or belongs to.
func semaphoreJSON(j *lockJSON, in sqllock.LockInfo, sems map[string]*semaphore) {
	if sem, ok := sqllock.ParseLimitKey(in.Key); ok && sems[sem] != nil {
		j.Semaphore, j.Permits, j.PermitsHeld = sem, sems[sem].permits, &sems[sem].held
		return
	}
	if sem, _, ok := sqllock.ParsePermitKey(in.Key); ok && sems[sem] != nil {
		j.Semaphore = sem
	}
}
