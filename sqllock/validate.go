package sqllock

import (
	"fmt"
	"strings"
	"time"
	"unicode/utf8"
)

// Input bounds shared by every backend. A backend refuses anything outside
// them before any I/O, with the same error, so that a program behaves the
// same on memory, SQLite and PostgreSQL.
const (
	MaxKeyLen   = 512  // bytes
	MaxOwnerLen = 512  // bytes
	MaxValueLen = 4096 // bytes
	MinTTL      = time.Millisecond
	MaxTTL      = 24 * time.Hour
)

// ValidateKey reports whether key is acceptable to every backend. The error
// matches [ErrInvalidKey].
func ValidateKey(key string) error {
	if err := validateText(key, MaxKeyLen); err != "" {
		return fmt.Errorf("%w: %s", ErrInvalidKey, err)
	}
	return nil
}

// ValidateOwner reports whether owner is acceptable to every backend. The
// error matches [ErrInvalidOwner].
func ValidateOwner(owner string) error {
	if err := validateText(owner, MaxOwnerLen); err != "" {
		return fmt.Errorf("%w: %s", ErrInvalidOwner, err)
	}
	return nil
}

func validateText(s string, maxLen int) string {
	switch {
	case s == "":
		return "empty"
	case len(s) > maxLen:
		return fmt.Sprintf("%d bytes, more than %d", len(s), maxLen)
	case !utf8.ValidString(s):
		return "not valid UTF-8"
	case strings.IndexByte(s, 0) >= 0:
		return "contains a NUL byte"
	}
	return ""
}

// ValidateValue reports whether value, a lease's opaque value, fits every
// backend: any bytes, at most [MaxValueLen]. The error matches
// [ErrInvalidValue].
func ValidateValue(value []byte) error {
	if len(value) > MaxValueLen {
		return fmt.Errorf("%w: %d bytes, more than %d", ErrInvalidValue, len(value), MaxValueLen)
	}
	return nil
}

// ValidateTTL reports whether ttl lies within [[MinTTL], [MaxTTL]]. Backends
// store a TTL at their own resolution (PostgreSQL microseconds, SQLite
// milliseconds) and must round it up, never down, so that a lease never ends
// at the backend before the client's local deadline. The error matches
// [ErrInvalidTTL].
func ValidateTTL(ttl time.Duration) error {
	if ttl < MinTTL || ttl > MaxTTL {
		return fmt.Errorf("%w: %v is outside [%v, %v]", ErrInvalidTTL, ttl, MinTTL, MaxTTL)
	}
	return nil
}

// Validate checks every field of the request; backends call it first. A
// key of the shape of a semaphore's permit or limit ([PermitKey],
// [LimitKey]) or of a reader slot ([SharedKey]) is refused: only
// [PermitAcquirer] and a shared request grant those. A Shared request is
// refused with [ErrSharedUnsupported]: a backend that grants them calls
// [AcquireRequest.ValidateShared] instead.
func (r AcquireRequest) Validate() error {
	if err := ValidateKey(r.Key); err != nil {
		return err
	}
	if reservedKey(r.Key) {
		return fmt.Errorf("%w: %q has the shape of a semaphore's permit or limit key", ErrInvalidKey, r.Key)
	}
	if _, _, ok := ParseSharedKey(r.Key); ok {
		return fmt.Errorf("%w: %q has the shape of a reader slot's key", ErrInvalidKey, r.Key)
	}
	if err := ValidateTTL(r.TTL); err != nil {
		return err
	}
	if err := ValidateOwner(r.Owner); err != nil {
		return err
	}
	if r.MinHold != 0 {
		if err := ValidateTTL(r.MinHold); err != nil {
			return fmt.Errorf("min hold: %w", err)
		}
	}
	if err := ValidateValue(r.Value); err != nil {
		return err
	}
	if r.Shared {
		// A backend that grants shared requests validates them with
		// ValidateShared; any other refuses them here, before any I/O.
		return ErrSharedUnsupported
	}
	return nil
}

// ValidateLease checks a lease passed to TryRenew or Release: a valid key, a
// positive token (no backend ever grants token 0 or below), and an owner that
// is empty or valid (Release records it as who released). The errors match
// [ErrInvalidKey], [ErrInvalidToken] or [ErrInvalidOwner].
func ValidateLease(l Lease) error {
	if err := ValidateKey(l.Key); err != nil {
		return err
	}
	if l.Token <= 0 {
		return fmt.Errorf("%w: %d is not a granted token", ErrInvalidToken, l.Token)
	}
	if l.Owner != "" {
		return ValidateOwner(l.Owner)
	}
	return nil
}

// ValidatePrefix checks a List prefix: empty (all keys), or valid UTF-8
// without NUL and at most [MaxKeyLen] bytes. The error matches
// [ErrInvalidKey].
func ValidatePrefix(prefix string) error {
	if prefix == "" {
		return nil
	}
	return ValidateKey(prefix)
}

// ValidateRenewBatch checks every element of a batch renewal as TryRenew
// checks its arguments ([ValidateLease], [ValidateTTL]) and returns the
// first bad element's error, which names its index and matches the same
// sentinel.
func ValidateRenewBatch(reqs []RenewRequest) error {
	for i, r := range reqs {
		if err := ValidateLease(r.Lease); err != nil {
			return fmt.Errorf("renewal %d of %d: %w", i, len(reqs), err)
		}
		if err := ValidateTTL(r.TTL); err != nil {
			return fmt.Errorf("renewal %d of %d: %w", i, len(reqs), err)
		}
	}
	return nil
}
