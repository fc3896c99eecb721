package sqllock

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
)

// PermitAcquirer is implemented by backends that keep semaphores: a
// semaphore K with a limit of N permits, each permit an ordinary fenced
// lease. The [Client] detects it ([Client.AcquirePermit]); a backend
// without it makes the Client return a [*UnsupportedError] naming the
// backend.
//
// # Layout
//
// Permit i of semaphore K (1 <= i <= N) is the key [PermitKey](K, i): a
// row (or key) of its own with its own token, strictly increasing per
// permit, its own deadline by the backend's clock, its owner and value.
// [Backend.TryRenew], [Backend.Release], [BatchRenewer.TryRenewBatch],
// List, loss detection and fenced transactions treat it as any key. The
// limit N is stored with the semaphore, under [LimitKey](K) (a row whose
// token is N, never held), by the first grant of K, together with the N
// permits (all free but the one granted), and never changes: a request
// with another N is refused with a [*PermitLimitError]. To change a
// semaphore's limit, use a new key.
//
// # Rules
//
//   - A grant takes one permit of K that is free (released, or expired by
//     the backend's clock), in one statement (one round trip), and gives
//     it a new tenure exactly as [Backend.TryAcquire] would: token =
//     previous token + 1, held, deadline = now + TTL, owner, value. So at
//     no instant of the backend's clock are more than N permits of K held.
//   - If a permit of K is held, unexpired, by req.Owner, the request is a
//     retry of an acquire whose reply was lost: that grant is returned
//     again, same key and token, its deadline extended to now + TTL, and
//     no other permit is taken. (On PostgreSQL, whose permit acquire
//     skips locked rows, a retry sent while the first attempt's commit
//     still holds its row, a synchronous standby's wait for example,
//     takes another permit; the first stays the owner's, unused, until
//     its TTL ends: one permit fewer for a TTL, never more than N.)
//   - A refusal (every permit held, unexpired, by others) locks nothing
//     and writes nothing; its error is a [*PermitsHeldError] (matching
//     [ErrNotAcquired]) with every holder and the soonest end, read in
//     the same round trip. On PostgreSQL a permit row another transaction
//     has locked is skipped, not waited for.
//   - Bad input is refused before any I/O ([PermitRequest.Validate]).
//
// Release of a permit signals a [Watcher] of the semaphore key K as well
// as of the permit's own key, so a waiting [Client.AcquirePermit] wakes on
// any permit's release.
type PermitAcquirer interface {
	// TryAcquirePermit grants one permit of semaphore req.Key, whose limit
	// is req.Permits, to req.Owner, as the rules above say, and returns
	// the permit's lease (its Key is [PermitKey](req.Key, i)).
	//
	// Errors: [ErrNotAcquired] as a [*PermitsHeldError]; [ErrPermitLimit]
	// as a [*PermitLimitError] when the semaphore's stored limit differs;
	// [ErrTokenExhausted] when every free permit's token reached the
	// largest int64; [ErrIndeterminate], [ErrUnavailable],
	// [ErrSchemaMissing] and the validation errors as for TryAcquire.
	TryAcquirePermit(ctx context.Context, req PermitRequest) (Lease, error)
}

// PermitRequest is the input of [PermitAcquirer.TryAcquirePermit]. Its
// AcquireRequest's Key is the semaphore's key, not a permit's.
type PermitRequest struct {
	AcquireRequest
	// Permits is the semaphore's limit N, within [1, [MaxPermits]].
	Permits int
}

// MaxPermits is the largest limit a semaphore may have.
const MaxPermits = 1024

// The suffixes that make a semaphore's keys. A key of that shape is
// reserved: [AcquireRequest.Validate] refuses it, so a single-key acquire
// never takes a permit, or the row of a limit, outside the semaphore's
// rules.
const (
	permitInfix = "#permit-"
	limitSuffix = "#permits"
)

// PermitKey returns the key of permit i of semaphore sem: sem + "#permit-"
// + i in decimal.
func PermitKey(sem string, i int) string {
	return sem + permitInfix + strconv.Itoa(i)
}

// LimitKey returns the key under which semaphore sem's limit is stored:
// sem + "#permits".
func LimitKey(sem string) string { return sem + limitSuffix }

// ParsePermitKey reports whether key is a permit's key ([PermitKey]) and
// if so of which semaphore and which permit.
func ParsePermitKey(key string) (sem string, i int, ok bool) {
	at := strings.LastIndex(key, permitInfix)
	if at <= 0 {
		return "", 0, false
	}
	digits := key[at+len(permitInfix):]
	if digits == "" || digits[0] < '1' || digits[0] > '9' || len(digits) > 4 {
		return "", 0, false
	}
	n, err := strconv.Atoi(digits)
	if err != nil || n > MaxPermits {
		return "", 0, false
	}
	return key[:at], n, true
}

// ParseLimitKey reports whether key is a semaphore's limit key
// ([LimitKey]) and if so of which semaphore.
func ParseLimitKey(key string) (sem string, ok bool) {
	if len(key) <= len(limitSuffix) || !strings.HasSuffix(key, limitSuffix) {
		return "", false
	}
	return strings.TrimSuffix(key, limitSuffix), true
}

// reservedKey reports whether key has the shape of a semaphore's permit
// or limit key.
func reservedKey(key string) bool {
	if _, _, ok := ParsePermitKey(key); ok {
		return true
	}
	_, ok := ParseLimitKey(key)
	return ok
}

// ValidatePermits reports whether n is a valid limit: within [1,
// [MaxPermits]]. The error matches [ErrInvalidPermits].
func ValidatePermits(n int) error {
	if n < 1 || n > MaxPermits {
		return fmt.Errorf("%w: %d is outside [1, %d]", ErrInvalidPermits, n, MaxPermits)
	}
	return nil
}

// Validate checks the request as [AcquireRequest.Validate] does (the
// semaphore's key may not itself be a permit's or a limit's key), and
// that the limit is valid, the keys of every permit and of the limit fit
// [MaxKeyLen], and no min hold is asked: a permit takes none (the error
// matches [ErrMinHoldUnsupported]). Backends call it first.
func (r PermitRequest) Validate() error {
	if err := r.AcquireRequest.Validate(); err != nil {
		return err
	}
	if err := ValidatePermits(r.Permits); err != nil {
		return err
	}
	if n := max(len(PermitKey(r.Key, r.Permits)), len(LimitKey(r.Key))); n > MaxKeyLen {
		return fmt.Errorf("%w: the semaphore's keys would be %d bytes, more than %d", ErrInvalidKey, n, MaxKeyLen)
	}
	if r.MinHold != 0 {
		return fmt.Errorf("%w: a permit takes no min hold", ErrMinHoldUnsupported)
	}
	return nil
}

var (
	// ErrInvalidPermits is returned, before any I/O, for a semaphore limit
	// outside [1, [MaxPermits]].
	ErrInvalidPermits = errors.New("sqllock: invalid number of permits")

	// ErrPermitLimit is returned by a permit acquire whose limit differs
	// from the one stored with the semaphore; the error is a
	// [*PermitLimitError].
	ErrPermitLimit = errors.New("sqllock: semaphore limit differs")

	// ErrUnsupported is returned by a Client method that needs a backend
	// capability the backend lacks; the error is an [*UnsupportedError].
	ErrUnsupported = errors.New("sqllock: not supported by this backend")
)

// PermitLimitError is the detail of [ErrPermitLimit].
type PermitLimitError struct {
	Key    string // the semaphore's key
	Asked  int    // the request's limit
	Stored int    // the semaphore's limit
}

func (e *PermitLimitError) Error() string {
	return fmt.Sprintf("sqllock: semaphore %q has %d permits, not %d (its limit never changes: use another key for another limit)", e.Key, e.Stored, e.Asked)
}

// Is makes a PermitLimitError match [ErrPermitLimit].
func (e *PermitLimitError) Is(target error) bool { return target == ErrPermitLimit }

// UnsupportedError is the detail of [ErrUnsupported].
type UnsupportedError struct {
	Backend string // the backend's name ([Options.BackendName])
	What    string // the capability, e.g. "semaphores"
	Need    string // the interface it must implement, e.g. "sqllock.PermitAcquirer"
}

func (e *UnsupportedError) Error() string {
	return fmt.Sprintf("sqllock: the %s backend does not support %s (it does not implement %s)", e.Backend, e.What, e.Need)
}

// Is makes an UnsupportedError match [ErrUnsupported].
func (e *UnsupportedError) Is(target error) bool { return target == ErrUnsupported }

// PermitHolder is one held permit, as a refused permit acquire reports it.
type PermitHolder struct {
	Key       string        // the permit's key ([PermitKey])
	Owner     string        // its holder
	Token     int64         // its token
	Remaining time.Duration // its remaining lease by the backend clock
	Value     []byte        // its value (nil for none)
}

// PermitsHeldError is the detail of [ErrNotAcquired] for a permit acquire:
// every permit of the semaphore is held. It also matches a [*HeldError]
// with [errors.As]: the holder whose lease ends soonest, so that a waiter
// sleeps at most until then.
type PermitsHeldError struct {
	Key     string         // the semaphore's key
	Permits int            // its limit
	Holders []PermitHolder // in permit order; empty when the backend could not see them (a lost race)
	// Remaining is the soonest end of a holder's lease by the backend
	// clock (0 when Holders is empty).
	Remaining time.Duration
}

func (e *PermitsHeldError) Error() string {
	if len(e.Holders) == 0 {
		return fmt.Sprintf("sqllock: not acquired: every permit of %q is held", e.Key)
	}
	return fmt.Sprintf("sqllock: not acquired: the %d permits of %q are held by %d holders, the soonest free in %v", e.Permits, e.Key, len(e.Holders), e.Remaining)
}

// Is makes a PermitsHeldError match [ErrNotAcquired].
func (e *PermitsHeldError) Is(target error) bool { return target == ErrNotAcquired }

// As fills a **HeldError with the holder whose lease ends soonest (one
// with no Owner when Holders is empty).
func (e *PermitsHeldError) As(target any) bool {
	p, ok := target.(**HeldError)
	if !ok {
		return false
	}
	he := &HeldError{Key: e.Key}
	if h, ok := e.Soonest(); ok {
		he = &HeldError{Key: h.Key, Owner: h.Owner, Token: h.Token, Remaining: h.Remaining, Value: h.Value}
	}
	*p = he
	return true
}

// Soonest returns the holder whose lease ends first; ok is false when
// Holders is empty.
func (e *PermitsHeldError) Soonest() (h PermitHolder, ok bool) {
	for i, x := range e.Holders {
		if i == 0 || x.Remaining < h.Remaining {
			h = x
		}
	}
	return h, len(e.Holders) > 0
}

// NewPermitsHeldError builds a refusal's error from the holders a
// backend read (any order), computing the soonest end.
func NewPermitsHeldError(sem string, permits int, holders []PermitHolder) *PermitsHeldError {
	slices.SortFunc(holders, func(a, b PermitHolder) int {
		_, i, _ := ParsePermitKey(a.Key)
		_, j, _ := ParsePermitKey(b.Key)
		return cmp.Compare(i, j)
	})
	e := &PermitsHeldError{Key: sem, Permits: permits, Holders: holders}
	if h, ok := e.Soonest(); ok {
		e.Remaining = h.Remaining
	}
	return e
}
