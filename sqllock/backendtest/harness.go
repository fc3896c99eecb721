// Package backendtest is the conformance suite every [sqllock.Backend] must
// pass, in the spirit of testing/fstest: a backend package calls [Run] from a
// test with a [Harness] that builds fresh backends.
package backendtest

import (
	"testing"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// Harness tells [Run] how to build and manipulate a backend under test.
type Harness struct {
	// New returns a fresh, empty backend: no keys, its own table or schema.
	// Its resources are released with t.Cleanup.
	New func(t *testing.T) sqllock.Backend

	// Expire makes key's current lease expire now, without sleeping: it sets
	// the deadline to at or before the backend's now (an UPDATE of deadline
	// for SQL backends, a hook for memory). It must not change the token or
	// the held flag.
	Expire func(t *testing.T, b sqllock.Backend, key string)

	// SetToken, if not nil, makes key exist, released, with the given
	// current token, so that Run can check token exhaustion near the end of
	// int64 without acquiring 2^63 times.
	SetToken func(t *testing.T, b sqllock.Backend, key string, token int64)

	// NoMinHold says the backend does not keep AcquireRequest.MinHold:
	// Run then checks that it refuses a request with one (matching
	// sqllock.ErrMinHoldUnsupported, leaving no trace) instead of the
	// min-hold rules.
	NoMinHold bool

	// MinHoldRoundUp is how much longer than asked the backend may keep
	// a short min hold (etcd: its leases' whole seconds and the server's
	// minimum lease TTL); the rule that a release after the hold frees
	// the key at once waits that much longer for the hold to pass. Zero
	// for a backend that keeps a hold to the millisecond.
	MinHoldRoundUp time.Duration

	// MarkRoundUp is how much longer than its TTL the backend may keep a
	// short waiting writer's mark (etcd: the whole seconds and minimum
	// TTL of the mark's etcd lease); the rule that a mark ends by itself
	// waits that much longer. Zero for a backend that keeps it to the
	// millisecond.
	MarkRoundUp time.Duration

	// Shared says the backend grants shared requests
	// (sqllock.AcquireRequest.Shared): Run then checks the rules of shared
	// locks; otherwise that it refuses a shared request before any I/O
	// (matching sqllock.ErrSharedUnsupported), leaving no trace.
	Shared bool
}
