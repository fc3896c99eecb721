package sqllock

import (
	"errors"
	"fmt"
	"time"
)

// Sentinel errors. Match them with [errors.Is]; read the details of
// [ErrNotAcquired] and [ErrLeaseLost] with [errors.As] into a [*HeldError] or a
// [*LostError].
var (
	// ErrNotAcquired is returned by TryAcquire (and by Acquire when its wait
	// ends) when another lease on the key is held and has not expired. The
	// error is a [*HeldError] naming the holder and its remaining time.
	ErrNotAcquired = errors.New("sqllock: not acquired")

	// ErrLeaseLost means the lease is no longer valid: it expired, was taken
	// by a newer token, was released (for example with `sqllock release
	// --force`), the backend could not be reached before the local
	// deadline, or the Guard reached its [AcquireOptions.MaxHold]. The error is a [*LostError] with the reason. It is returned by
	// TryRenew and Release, and is the [context.Cause] of a lost Guard.
	ErrLeaseLost = errors.New("sqllock: lease lost")

	// ErrReleased is the [context.Cause] of a Guard's context after Release,
	// and the error of Renew on a released Guard.
	ErrReleased = errors.New("sqllock: released")

	// ErrInvalidKey is returned, before any I/O, for a key that is empty,
	// longer than [MaxKeyLen] bytes, not valid UTF-8 or containing NUL.
	ErrInvalidKey = errors.New("sqllock: invalid key")

	// ErrInvalidTTL is returned, before any I/O, for a TTL outside
	// [[MinTTL], [MaxTTL]], or for renew settings that do not fit the TTL.
	ErrInvalidTTL = errors.New("sqllock: invalid ttl")

	// ErrInvalidOwner is returned, before any I/O, for an owner that is empty,
	// longer than [MaxOwnerLen] bytes, not valid UTF-8 or containing NUL.
	ErrInvalidOwner = errors.New("sqllock: invalid owner")

	// ErrInvalidValue is returned, before any I/O, for a lease value longer
	// than [MaxValueLen] bytes.
	ErrInvalidValue = errors.New("sqllock: invalid value")

	// ErrInvalidToken is returned, before any I/O, by TryRenew and Release
	// for a lease whose token is not positive (never granted).
	ErrInvalidToken = errors.New("sqllock: invalid token")

	// ErrIndeterminate means the outcome of an operation is unknown: the
	// request may have been applied but its reply was lost (for example the
	// context ended while the statement was in flight). An acquire that ends
	// this way hands out no Guard; repeating the same [AcquireRequest] (same
	// Owner) returns the same grant if it was applied, never a second tenure.
	ErrIndeterminate = errors.New("sqllock: outcome indeterminate")

	// ErrUnavailable marks a transient backend failure: the database could not
	// be reached, the connection broke, or the server is read-only (a standby
	// after failover). The scheduler retries such errors until the local
	// deadline; they are never a lease loss by themselves.
	ErrUnavailable = errors.New("sqllock: backend unavailable")

	// ErrSchemaMissing means the lock table does not exist. Create it with
	// `sqllock migrate up` or the migrations package.
	ErrSchemaMissing = errors.New("sqllock: lock table missing (run `sqllock migrate up`)")

	// ErrTokenExhausted is returned when a key's token reached the largest
	// int64. Tokens never wrap; the key cannot be granted again.
	ErrTokenExhausted = errors.New("sqllock: fencing token space exhausted")

	// ErrClosed is returned by every Client method after [Client.Close].
	ErrClosed = errors.New("sqllock: client closed")
)

// HeldError is the detail of [ErrNotAcquired]: who holds the key and for how
// long, by the backend's clock, as read in the same round trip as the failed
// attempt. Owner and Remaining may be zero when the backend could not tell
// (a concurrent first insert of the key).
type HeldError struct {
	Key       string
	Owner     string        // the holder's owner string; empty when the backend could not see the holder (a lost race for a new row)
	Token     int64         // the holder's token (0 when unknown)
	Remaining time.Duration // the holder's remaining lease by the backend clock
	Value     []byte        // the holder's value (nil when none, or when Owner is empty)
	// Shared is the number of shared holders when the key is held shared
	// (Owner is then empty and Remaining is the time until the last
	// shared lease ends, unless released), else 0.
	Shared int
	// WaitingWriter is set when a shared request was refused by a
	// writer's mark: the waiting writer's owner. Remaining is then the
	// exclusive holder's remaining lease, or the mark's if none holds.
	WaitingWriter string
}

func (e *HeldError) Error() string {
	switch {
	case e.WaitingWriter != "" && e.Owner != "":
		return fmt.Sprintf("sqllock: not acquired: %q is held by %q for %v more, and writer %q waits for it", e.Key, e.Owner, e.Remaining, e.WaitingWriter)
	case e.WaitingWriter != "":
		return fmt.Sprintf("sqllock: not acquired: writer %q waits for %q (shared holders: %d), for %v more at most", e.WaitingWriter, e.Key, e.Shared, e.Remaining)
	case e.Shared > 0:
		return fmt.Sprintf("sqllock: not acquired: %q is held shared by %d holders, the last for %v more at most", e.Key, e.Shared, e.Remaining)
	}
	if e.Owner == "" {
		return fmt.Sprintf("sqllock: not acquired: %q is held", e.Key)
	}
	return fmt.Sprintf("sqllock: not acquired: %q is held by %q for %v more", e.Key, e.Owner, e.Remaining)
}

// Is makes a HeldError match [ErrNotAcquired].
func (e *HeldError) Is(target error) bool { return target == ErrNotAcquired }

// LostReason tells why a lease was lost.
type LostReason int

// The reasons a lease can be lost.
const (
	// LostExpired: the lease's deadline passed by the backend's clock.
	LostExpired LostReason = iota + 1
	// LostTaken: a newer token was granted on the key.
	LostTaken
	// LostReleased: the lease was released by someone other than its
	// holder (a forced release), or its row was removed.
	LostReleased
	// LostUnreachable: the local deadline passed without a successful
	// renewal: renewals failed with transient errors, got no reply in time,
	// or were not sent at all (the process was paused); the lease may still
	// exist at the backend, but the holder can no longer be sure. The client
	// knows only that no renewal succeeded, not why; [LostError.Err] is the
	// last renewal error, nil when no renewal failed.
	LostUnreachable
	// LostMaxHold: the Guard held the key for its [AcquireOptions.MaxHold]
	// and was ended by its own client. The lease may still exist at the
	// backend until its deadline; no renewal extends it any more.
	LostMaxHold
)

func (r LostReason) String() string {
	switch r {
	case LostExpired:
		return "expired"
	case LostTaken:
		return "taken by a newer token"
	case LostReleased:
		return "released"
	case LostUnreachable:
		return "not renewed before the local deadline"
	case LostMaxHold:
		return "held for its maximum hold"
	default:
		return fmt.Sprintf("LostReason(%d)", int(r))
	}
}

// Name returns the reason as one stable lower-case word, fit for a log
// attribute or a metric label: expired, taken, released, unreachable or
// max_hold.
func (r LostReason) Name() string {
	switch r {
	case LostExpired:
		return "expired"
	case LostTaken:
		return "taken"
	case LostReleased:
		return "released"
	case LostUnreachable:
		return "unreachable"
	case LostMaxHold:
		return "max_hold"
	default:
		return "unknown"
	}
}

// LostError is the detail of [ErrLeaseLost].
type LostError struct {
	Key    string
	Token  int64      // the token of the lost lease
	Reason LostReason // why it was lost
	// Current is the key's current token when the backend reported it
	// (LostTaken), else 0.
	Current int64
	// By is the owner recorded by the release that ended the lease
	// (LostReleased), when the backend reported it, else "".
	By string
	// Err is the last backend error seen, if any (for LostUnreachable).
	Err error
}

func (e *LostError) Error() string {
	s := fmt.Sprintf("sqllock: lease lost: %q token %d %s", e.Key, e.Token, e.Reason)
	if e.Reason == LostTaken && e.Current > 0 {
		s += fmt.Sprintf(" (current token %d)", e.Current)
	}
	if e.Reason == LostReleased && e.By != "" {
		s += fmt.Sprintf(" by %q", e.By)
	}
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Is makes a LostError match [ErrLeaseLost].
func (e *LostError) Is(target error) bool { return target == ErrLeaseLost }

// Unwrap returns the last backend error, if any.
func (e *LostError) Unwrap() error { return e.Err }

// KeyState is a key's row as a backend read it: what every backend needs to
// tell, the same way, why a lease is no longer valid.
type KeyState struct {
	Found   bool   // the key has a row (rows are never deleted)
	Token   int64  // the key's current token
	Held    bool   // the row is held (expired or not)
	Expired bool   // its deadline has passed by the backend's clock
	Owner   string // the holder, or who released it last; "" when not read
}

// Loss returns why lease l is not valid in state s, or nil when s shows l
// held and unexpired. A lease released by someone else names them (By).
func (s KeyState) Loss(l Lease) *LostError {
	// Built only for a loss: Loss runs on every renewal and release, and a
	// LostError made up front would cost each of them an allocation.
	switch {
	case !s.Found || l.Token > s.Token:
		// Nothing was ever granted under l.Token here.
		return &LostError{Key: l.Key, Token: l.Token, Reason: LostReleased}
	case l.Token < s.Token:
		return &LostError{Key: l.Key, Token: l.Token, Reason: LostTaken, Current: s.Token}
	case !s.Held:
		return &LostError{Key: l.Key, Token: l.Token, Reason: LostReleased, By: s.Owner}
	case s.Expired:
		return &LostError{Key: l.Key, Token: l.Token, Reason: LostExpired}
	}
	return nil
}

// ReleasedByOwner reports whether s shows lease l released by l's own
// owner: a release repeated by the owner that made it, which is no loss.
func (s KeyState) ReleasedByOwner(l Lease) bool {
	return s.Found && s.Token == l.Token && !s.Held && s.Owner == l.Owner
}

// ErrMinHoldUnsupported is returned, before any I/O, by a backend that
// cannot keep [AcquireRequest.MinHold] (Acquire, TryAcquire and Do pass it
// on), so that a minimum hold is never silently dropped.
var ErrMinHoldUnsupported = errors.New("sqllock: this backend does not support a minimum hold")
