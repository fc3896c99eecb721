package sqllock

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"time"
)

// MaxKeysPerAcquire is the most keys one all-or-nothing acquire
// ([MultiAcquirer]) takes. A set is one statement on the SQL backends and
// one transaction on etcd; more keys than this is bad input, refused
// before any I/O.
const MaxKeysPerAcquire = 64

// ErrMultiAcquireUnsupported is returned, before any I/O, by
// [Client.AcquireAll] on a backend that does not implement
// [MultiAcquirer]; the error names the backend. A set of keys is never
// taken one key at a time in its stead: that is the partial grant the
// capability exists to rule out.
var ErrMultiAcquireUnsupported = errors.New("sqllock: this backend cannot grant a set of keys all or none")

// MultiAcquirer is implemented by backends that grant a set of keys all or
// none: every key of the set in one atomic step, or not one of them. The
// [Client] discovers it ([Client.AcquireAll]); without it, AcquireAll
// fails with [ErrMultiAcquireUnsupported].
type MultiAcquirer interface {
	// TryAcquireAll grants every key of req.Keys to req.Owner, or none,
	// in one atomic step at one instant of the backend's clock: one
	// statement on the SQL backends, one transaction on etcd.
	//
	// Each key is judged as [Backend.TryAcquire] judges it, and each
	// granted key gets the lease a TryAcquire of it alone would have got:
	// its own token (previous token + 1, strictly greater than every
	// token ever issued for that key; a fresh key's first row is written
	// by the same step), deadline = now + TTL, req.Value stored with it.
	// A key held, unexpired, by req.Owner itself is a retry of this very
	// request after a lost reply: it keeps its token and its deadline is
	// extended to now + TTL, so repeating a request whose reply was lost
	// returns the same tokens, never a second tenure.
	//
	// The backend takes the keys in ascending byte order (as Go sorts
	// strings), so that two requests whose sets overlap cannot deadlock
	// each other, and it never waits for a key another transaction has
	// locked (PostgreSQL: a row locked by another transaction counts as
	// held).
	//
	// It returns one Lease per key, in the order of req.Keys. When a key
	// cannot be granted, nothing is granted and nothing of the set
	// changes: the error is that of the first such key in ascending order,
	// as TryAcquire would return it: [ErrNotAcquired] as a [*HeldError]
	// naming the key, its holder, token and remaining time from the same
	// step (Owner empty when the backend could not see the holder: a row
	// locked by another transaction or a concurrent first insert; try
	// again), or [ErrTokenExhausted] naming the key. Other errors as
	// TryAcquire's: [ErrIndeterminate] when the request may have been
	// applied but the reply was lost (repeating it with the same Owner
	// settles it), [ErrUnavailable], [ErrSchemaMissing].
	//
	// It validates the request first ([MultiAcquireRequest.Validate]) and
	// refuses bad input before any I/O.
	TryAcquireAll(ctx context.Context, req MultiAcquireRequest) ([]Lease, error)
}

// MultiAcquireRequest is the input of [MultiAcquirer.TryAcquireAll]: one
// owner, TTL and value for every key of the set. It has no minimum hold.
type MultiAcquireRequest struct {
	// Keys are the keys to take together: at least one, at most
	// [MaxKeysPerAcquire], each valid ([ValidateKey]), none twice. Their
	// order is the caller's: the backend sorts a copy.
	Keys []string
	// TTL is each lease's duration; see [ValidateTTL].
	TTL time.Duration
	// Owner is each lease's owner and identifies this acquire call, as
	// [AcquireRequest.Owner] does.
	Owner string
	// Value is stored with every key's lease, as [AcquireRequest.Value].
	Value []byte
}

// Validate checks every field of the request; backends call it first.
// A set that is empty, has more than [MaxKeysPerAcquire] keys or a key
// twice is refused with an error matching [ErrInvalidKey], as is a bad key
// (the error names its index).
func (r MultiAcquireRequest) Validate() error {
	switch {
	case len(r.Keys) == 0:
		return fmt.Errorf("%w: an empty set of keys", ErrInvalidKey)
	case len(r.Keys) > MaxKeysPerAcquire:
		return fmt.Errorf("%w: %d keys in one set, more than %d", ErrInvalidKey, len(r.Keys), MaxKeysPerAcquire)
	}
	for i, k := range r.Keys {
		if err := ValidateKey(k); err != nil {
			return fmt.Errorf("key %d of %d: %w", i, len(r.Keys), err)
		}
		if reservedKey(k) {
			// A set must not take a semaphore's permit past its limit.
			return fmt.Errorf("%w: key %d of %d, %q, has the shape of a semaphore's permit or limit key", ErrInvalidKey, i, len(r.Keys), k)
		}
		if _, _, ok := ParseSharedKey(k); ok {
			// Nor a reader's slot outside the rules of shared locks.
			return fmt.Errorf("%w: key %d of %d, %q, has the shape of a reader slot's key", ErrInvalidKey, i, len(r.Keys), k)
		}
	}
	sorted := SortedKeys(r.Keys)
	for i := 1; i < len(sorted); i++ {
		if sorted[i] == sorted[i-1] {
			return fmt.Errorf("%w: %q is in the set twice", ErrInvalidKey, sorted[i])
		}
	}
	if err := ValidateTTL(r.TTL); err != nil {
		return err
	}
	if err := ValidateOwner(r.Owner); err != nil {
		return err
	}
	return ValidateValue(r.Value)
}

// SortedKeys returns a sorted copy of keys: the order in which a
// [MultiAcquirer] takes them.
func SortedKeys(keys []string) []string {
	s := slices.Clone(keys)
	slices.Sort(s)
	return s
}

// ValidateReleaseAll checks the input of [MultiReleaser.ReleaseAll]: at
// least one lease and at most [MaxKeysPerAcquire], each valid
// ([ValidateLease]) with an owner, not a semaphore's permit or limit key,
// every one with the same owner (one set's), and no key twice. The error
// matches [ErrInvalidKey], [ErrInvalidToken] or [ErrInvalidOwner] and names
// the lease's index.
func ValidateReleaseAll(ls []Lease) error {
	switch {
	case len(ls) == 0:
		return fmt.Errorf("%w: an empty set of leases to release", ErrInvalidKey)
	case len(ls) > MaxKeysPerAcquire:
		return fmt.Errorf("%w: %d leases in one release, more than %d", ErrInvalidKey, len(ls), MaxKeysPerAcquire)
	}
	seen := make(map[string]struct{}, len(ls))
	for i, l := range ls {
		if err := ValidateLease(l); err != nil {
			return fmt.Errorf("lease %d of %d: %w", i, len(ls), err)
		}
		if err := ValidateOwner(l.Owner); err != nil {
			return fmt.Errorf("lease %d of %d: %w", i, len(ls), err)
		}
		if l.Owner != ls[0].Owner {
			return fmt.Errorf("%w: lease %d of %d has owner %q, lease 0 %q: one release takes one set's leases", ErrInvalidOwner, i, len(ls), l.Owner, ls[0].Owner)
		}
		if reservedKey(l.Key) {
			return fmt.Errorf("%w: lease %d of %d, %q, has the shape of a semaphore's permit or limit key", ErrInvalidKey, i, len(ls), l.Key)
		}
		if _, _, slot := ParseSharedKey(l.Key); slot {
			// A reader's release also updates its key's summary, which a
			// set's release statement knows nothing of.
			return fmt.Errorf("%w: lease %d of %d, %q, is a shared grant's reader slot: release it with Release", ErrInvalidKey, i, len(ls), l.Key)
		}
		if _, dup := seen[l.Key]; dup {
			return fmt.Errorf("%w: %q is in the release twice", ErrInvalidKey, l.Key)
		}
		seen[l.Key] = struct{}{}
	}
	return nil
}
