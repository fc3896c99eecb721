package sqllock

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"os"
	"time"
)

// Defaults for [Options] and [AcquireOptions].
const (
	DefaultTTL            = 30 * time.Second
	DefaultReleaseTimeout = 5 * time.Second
	DefaultMaxRenewBatch  = 1000
)

// WaitForever, as [AcquireOptions.Wait], makes Acquire and Do wait until
// they hold the key or their context ends. It is the longest
// time.Duration (about 292 years), so it is an ordinary positive bound
// too; the zero Wait means one attempt.
const WaitForever time.Duration = math.MaxInt64

// Options configure a [Client]. The zero value of every field means its
// default, so Options{} is a working configuration.
type Options struct {
	// Owner names this client in every lease it takes (`sqllock list` shows
	// it). Each acquire call appends a per-Client random number and its own
	// sequence number, so that a retry of one call is recognised and two
	// calls never share an owner, even from Clients given the same Owner.
	// Default: "host:pid:random". At most MaxOwnerLen-34 bytes.
	Owner string

	// Logger receives lease losses (Warn), failed releases (Warn) and
	// transient renewal and acquire failures (Debug), through the *Context
	// methods (so a handler can read the Guard's or the call's context),
	// with these attributes: key, token, owner (the lease's), backend
	// (BackendName), reason (a loss's [LostReason.Name]), attempt and err.
	// nil discards.
	Logger *slog.Logger

	// TTL is the lease duration when AcquireOptions.TTL is zero. Default
	// [DefaultTTL]. See [ValidateTTL] for the bounds.
	TTL time.Duration

	// RenewInterval is how often a Guard renews its lease. Default: a third
	// of the lease's TTL. It must be at least [MinInterval] and at most half
	// the TTL of every lease the client takes, so that one failed renewal
	// leaves time for another.
	RenewInterval time.Duration

	// RenewWindow is how early a lease may be renewed so that it shares a
	// round trip with others: when a lease comes due, every lease due
	// within the window is renewed with it, in one batch on a backend that
	// renews many leases at once ([BatchRenewer]; memory, SQLite and
	// PostgreSQL do). Leases renewed together stay together, so a client
	// holding thousands of leases sends a few statements per renew
	// interval instead of one per lease. Default: a quarter of the lease's
	// renew interval. It must be at least [MinInterval] and at most half
	// the renew interval of every lease the client takes.
	RenewWindow time.Duration

	// MaxRenewBatch bounds the leases renewed by one call to the backend;
	// more leases due at once are sent as several batches, in parallel.
	// Default [DefaultMaxRenewBatch].
	MaxRenewBatch int

	// Margin is the safety margin subtracted from the local deadline:
	// local deadline = (monotonic time just before the request was sent) +
	// TTL - Margin. It absorbs clock-rate differences between this host and
	// the database and scheduling delays. Default: TTL/100 + 2ms, capped at
	// TTL/4 for very short TTLs. When set, it must be at least [MinInterval]
	// and less than half the TTL.
	Margin time.Duration

	// Backoff returns how long to wait before the attempt-th retry (attempt
	// starts at 1), jitter included: between acquire attempts on a held key
	// (capped by the holder's remaining lease) and between failed renewals.
	// It must be safe for concurrent use and should be stateless. Default
	// [DefaultBackoff].
	Backoff func(attempt int) time.Duration

	// ReleaseTimeout bounds a release made on the caller's behalf: by Do, by
	// Close, after the Guard's parent context ended, or by Release called
	// with a context that is already done. Default [DefaultReleaseTimeout].
	ReleaseTimeout time.Duration

	// Observer receives the client's events: acquire attempts and calls,
	// renewals, releases, losses, and Guards starting and ending. nil, the
	// default, observes nothing at no cost. Package otelsqllock provides one
	// that records OpenTelemetry metrics and spans.
	Observer *Observer

	// BackendName names the backend in events and log records (the
	// "backend" attribute). Default: the package name of the Backend's
	// type, such as "postgres", "sqlite" or "memory".
	BackendName string
}

// AcquireOptions are per-call settings; a nil *AcquireOptions means the
// client's defaults.
type AcquireOptions struct {
	// TTL of this lease; default Options.TTL.
	TTL time.Duration
	// Wait bounds how long Acquire and Do wait for the key. Zero, the
	// default, makes one attempt: a held key is skipped with an error
	// matching [ErrNotAcquired], as TryAcquire does (a scheduled job that
	// every replica fires runs once). A positive Wait waits up to that;
	// [WaitForever] waits until the context ends. The bound ends the wait
	// only: the Guard lives on under the context passed to Acquire.
	// TryAcquire always makes one attempt, whatever Wait says.
	Wait time.Duration
	// Value is published with the lease (see [AcquireRequest.Value]): at
	// most [MaxValueLen] bytes, shown by List and `sqllock list` and to a
	// refused acquirer in its [*HeldError]. It is copied at the call.
	Value []byte
	// MinHold keeps the key held at least this long after the grant, by
	// the database clock, whenever the Guard is released (ShedLock's
	// lockAtLeastFor): Release before grant + MinHold ends the Guard
	// (ErrReleased) and leaves the key held by this lease's owner, same
	// token, until then, without this process having to live on; a holder
	// that crashes keeps it until the later of its lease's deadline and
	// grant + MinHold. For a job that every replica (or crontab) fires
	// once per period, a MinHold longer than the skew between their
	// timers plus the longest an acquire takes to be granted, and shorter
	// than the period, makes it run once per period, as long as the job
	// is shorter than the period. Zero: no minimum. See
	// [AcquireRequest.MinHold]; within the TTL bounds ([ValidateTTL]).
	MinHold time.Duration
	// MaxHold caps how long the Guard may hold the key (ShedLock's
	// lockAtMostFor, for a job that hangs): the Guard ends at the
	// monotonic instant the successful acquire request was sent +
	// MaxHold, or at its local deadline if that comes first, with a
	// [*LostError] of reason [LostMaxHold]. It matches [ErrLeaseLost], so
	// code that stops on a loss stops, and Do returns it. The Client
	// sends no renewal once the local deadline has reached the cap, so
	// the lease at the backend ends by its own deadline (at most a TTL
	// after the last renewal); the Client does not release it at the cap,
	// as the holder may still be running: its Release (Do's, when fn
	// returns) releases it at once, so that the next run need not wait
	// for the deadline. MaxHold never extends anything. Zero: no cap;
	// otherwise at least [MinInterval] ([*OptionError] before any I/O).
	MaxHold time.Duration
	// Shared asks for a shared (read) lease of the key: any number of
	// shared Guards may hold it at once, never beside an exclusive one
	// (docs/shared-locks.md). The Guard's Key is then the reader slot's
	// key ([SharedKey]); its token comes from the key's one counter, above
	// the last exclusive grant's. A waiting exclusive Acquire marks the
	// key so that new shared grants are refused until it is granted or
	// its mark's TTL ends: readers never starve a writer. No upgrade in
	// place: release the shared Guard before acquiring exclusive (a
	// waiting exclusive Acquire of a key whose shared Guard the caller
	// still holds waits for itself, as sync.RWMutex's Lock after RLock
	// does). A backend that does not grant shared leases gives
	// [ErrSharedUnsupported] before any I/O; Shared takes no MinHold, and
	// neither AcquireAll nor AcquirePermit takes it ([ErrInvalidOption]).
	Shared bool
}

// DefaultBackoff waits 5ms·2^(attempt-1), capped at 250ms, with full jitter
// over the upper half ([d/2, d]) so that waiters do not poll in step.
func DefaultBackoff(attempt int) time.Duration {
	d := 250 * time.Millisecond
	if attempt < 7 {
		d = min(d, 5*time.Millisecond<<max(attempt-1, 0))
	}
	return d/2 + rand.N(d/2+1)
}

// defaultMargin is TTL/100 + 2ms, capped at TTL/4.
func defaultMargin(ttl time.Duration) time.Duration {
	return min(ttl/100+2*time.Millisecond, ttl/4)
}

func defaultOwner() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown"
	}
	if len(host) > 200 {
		host = host[:200]
	}
	return fmt.Sprintf("%s:%d:%08x", host, os.Getpid(), rand.Uint32())
}

// MinInterval is the smallest Options.RenewInterval and Options.Margin that
// [New] accepts (zero still means the default). A bare number is
// nanoseconds: RenewInterval: 5 would renew every 5ns and flood the
// database, so it is refused rather than honoured.
const MinInterval = time.Millisecond

// ErrInvalidOption is matched (errors.Is) by the [*OptionError] that [New]
// returns for an Options field out of bounds. Such an error also matches
// [ErrInvalidTTL], as New has always documented.
var ErrInvalidOption = errors.New("sqllock: invalid option")

// OptionError says which option is out of bounds, and the bound: a timing
// that is not a TTL (ValidateTTL's errors are for TTLs).
type OptionError struct {
	Field string        // "RenewInterval", "RenewWindow", "Margin", "ReleaseTimeout", "AcquireOptions.Wait" or "AcquireOptions.MaxHold"
	Value time.Duration // as given
	Min   time.Duration // the smallest accepted value
}

func (e *OptionError) Error() string {
	s := fmt.Sprintf("sqllock: invalid option: %s %v: must be at least %v", e.Field, e.Value, e.Min)
	if e.Value > 0 {
		s += " (a bare number is nanoseconds; write e.g. 5*time.Second)"
	}
	return s
}

// Unwrap makes the error match [ErrInvalidOption] and, as these errors did
// before ErrInvalidOption existed, [ErrInvalidTTL].
func (e *OptionError) Unwrap() []error { return []error{ErrInvalidOption, ErrInvalidTTL} }

// settings are the resolved timings and the value of one lease.
type settings struct {
	timings
	value   []byte
	minHold time.Duration
	maxHold time.Duration // zero: no cap
	shared  bool
}

// timings are what a Guard keeps of its settings.
type timings struct {
	ttl, interval, margin, window time.Duration
}

// settingsFor resolves the timings of a lease from the client options and
// the per-call options, refusing combinations that cannot work.
func (o *Options) settingsFor(ao *AcquireOptions) (settings, error) {
	s := settings{timings: timings{ttl: o.TTL}}
	if ao != nil && ao.TTL != 0 {
		s.ttl = ao.TTL
	}
	if err := ValidateTTL(s.ttl); err != nil {
		return s, err
	}
	if ao != nil && ao.Wait < 0 {
		return s, &OptionError{Field: "AcquireOptions.Wait", Value: ao.Wait}
	}
	if ao != nil && ao.MinHold != 0 {
		if err := ValidateTTL(ao.MinHold); err != nil {
			return s, fmt.Errorf("AcquireOptions.MinHold: %w", err)
		}
		s.minHold = ao.MinHold
	}
	if ao != nil && ao.MaxHold != 0 {
		if ao.MaxHold < MinInterval {
			return s, &OptionError{Field: "AcquireOptions.MaxHold", Value: ao.MaxHold, Min: MinInterval}
		}
		s.maxHold = ao.MaxHold
	}
	if ao != nil && ao.Shared {
		if ao.MinHold != 0 {
			return s, fmt.Errorf("%w: a shared lease takes no min hold", ErrMinHoldUnsupported)
		}
		s.shared = true
	}
	if ao != nil && len(ao.Value) > 0 {
		if err := ValidateValue(ao.Value); err != nil {
			return s, err
		}
		s.value = bytes.Clone(ao.Value)
	}
	if o.RenewInterval > 0 && o.RenewInterval < MinInterval {
		return s, &OptionError{Field: "RenewInterval", Value: o.RenewInterval, Min: MinInterval}
	}
	if o.Margin > 0 && o.Margin < MinInterval {
		return s, &OptionError{Field: "Margin", Value: o.Margin, Min: MinInterval}
	}
	s.interval = o.RenewInterval
	if s.interval == 0 {
		s.interval = s.ttl / 3
	}
	if s.interval <= 0 || s.interval > s.ttl/2 {
		return s, fmt.Errorf("%w: renew interval %v must be in (0, TTL/2] for TTL %v", ErrInvalidTTL, s.interval, s.ttl)
	}
	if o.RenewWindow > 0 && o.RenewWindow < MinInterval {
		return s, &OptionError{Field: "RenewWindow", Value: o.RenewWindow, Min: MinInterval}
	}
	s.window = o.RenewWindow
	if s.window == 0 {
		s.window = s.interval / 4
	}
	if s.window < 0 || s.window > s.interval/2 {
		return s, fmt.Errorf("%w: renew window %v must be in [0, interval/2] for renew interval %v", ErrInvalidOption, s.window, s.interval)
	}
	s.margin = o.Margin
	if s.margin == 0 {
		s.margin = defaultMargin(s.ttl)
	}
	if s.margin < 0 || s.margin >= s.ttl/2 {
		return s, fmt.Errorf("%w: margin %v must be in [0, TTL/2) for TTL %v", ErrInvalidTTL, s.margin, s.ttl)
	}
	return s, nil
}
