package sqllock

import (
	"context"
	"time"
)

// Backend stores leases. It is the seam between the backend-agnostic
// [Client] and a database: memory, SQLite and PostgreSQL implement it, and
// the conformance suite in package backendtest checks any implementation.
//
// Every method validates its input first ([AcquireRequest.Validate],
// [ValidateLease], [ValidateTTL]) and refuses bad input before any I/O. The
// backend's own clock (the database clock) alone decides expiry. Every call
// after an acquire is scoped to the exact lease: key and token.
//
// Implementations must be safe for concurrent use.
type Backend interface {
	// TryAcquire grants req.Key iff the key has no lease, its lease is
	// released, or its deadline is at or before the backend's now. A grant
	// sets token = previous token + 1 (strictly greater than every token ever
	// issued for the key), held, deadline = now + TTL, owner = req.Owner,
	// in one atomic step. A key without a row (new, or deleted by a
	// [Reaper]) starts above the backend's floor, which is above every
	// token of every key ever reaped: G2 holds across reaping too.
	//
	// If the key is held, unexpired, by the same req.Owner, the request is a
	// retry of an acquire whose reply was lost: the backend returns that
	// grant again with the same token and extends its deadline to now + TTL
	// (so the caller's local deadline, counted from this request, stays
	// valid). Owners are unique per acquire call. The grant stores
	// req.Value, and a refusal's [*HeldError] carries the holder's value,
	// read in the same round trip.
	//
	// Errors: [ErrNotAcquired] as a [*HeldError] when held by another owner,
	// with the holder's remaining time from the same round trip;
	// [ErrTokenExhausted]; [ErrIndeterminate] when the request may have been
	// applied but the reply was lost; [ErrUnavailable] for transient
	// failures; [ErrSchemaMissing]; the validation errors.
	TryAcquire(ctx context.Context, req AcquireRequest) (Lease, error)

	// TryRenew extends the lease to now + ttl iff the key's lease is held,
	// its token equals l.Token and its deadline is after now. The token does
	// not change, so retrying a renew after an ambiguous reply is safe.
	//
	// Errors: [ErrLeaseLost] as a [*LostError] (expired, taken by a newer
	// token, or released) when the lease is no longer valid; it never
	// revives an expired lease or touches a newer one. [ErrUnavailable] and
	// other errors are transient.
	TryRenew(ctx context.Context, l Lease, ttl time.Duration) (Lease, error)

	// Release ends the lease iff l.Token is the key's current token: it
	// clears held, keeps the token (so the next grant continues above it)
	// and records l.Owner as the one who released. It never touches a
	// newer holder's lease. If the lease was no longer valid when released
	// (a newer token exists, or its deadline had passed) it returns
	// [ErrLeaseLost] as a [*LostError], so the caller learns its critical
	// section may have overlapped another; the row is cleared all the same
	// when the token is current.
	//
	// Releasing an already released lease returns nil if l.Owner released
	// it (a repeat, for instance after [ErrIndeterminate]), and
	// [ErrLeaseLost] with [LostReleased] if someone else did: a forced
	// release (by the token, under another owner, as `sqllock release
	// --force` does) ended the holder's lease while it worked.
	// [ErrIndeterminate] when the reply was lost; repeating the release is
	// harmless.
	Release(ctx context.Context, l Lease) error

	// List returns the keys that start with prefix, in key order, including
	// released and expired ones (their Held field is false).
	List(ctx context.Context, prefix string) ([]LockInfo, error)
}

// Watcher is implemented by backends that can tell waiters that a key was
// released, so that a waiting Acquire wakes at once instead of at its next
// poll. The client always polls as well, so a missed or spurious signal only
// costs time, never safety.
type Watcher interface {
	// Watch returns a channel that receives a value (coalesced: the channel
	// holds at most one) after key may have become free, and a function that
	// stops the watch and must be called once. Call Watch before the acquire
	// attempt it should follow, so that no release is missed in between.
	// The signal is promised for a release of a lease that an acquire
	// attempt through this backend was refused while the watch was on (as
	// a waiting Acquire's are): a backend may signal only such releases,
	// as the PostgreSQL backend does, so that releases nobody waits for
	// cost nothing.
	Watch(key string) (<-chan struct{}, func())
}

// BatchRenewer is implemented by backends that renew many leases in one
// round trip (one statement, one commit). The [Client] detects it and
// renews the leases that come due together in one call; without it, it
// calls [Backend.TryRenew] once per lease.
//
// Per-lease semantics are those of TryRenew: each element keeps its own
// key, token and deadline, and a lost lease never drags another down.
//
// A wrapper that embeds a backend to change its TryRenew must change (or
// hide) TryRenewBatch too: the embedded one is promoted, and the Client
// would renew through it.
type BatchRenewer interface {
	// TryRenewBatch renews each reqs[i].Lease by reqs[i].TTL as TryRenew
	// would, at one instant of the backend's clock, and returns one result
	// per request, in order. A lease given more than once (same key and
	// token) is renewed once, by the longest of its TTLs, and every one of
	// its elements reports that renewal. The same key with two tokens is
	// two leases: at most the current one is renewed.
	//
	// It validates every element first ([ValidateRenewBatch]) and refuses
	// a batch with any bad element before any I/O, returning that error and
	// no results. An empty batch returns no results and does no I/O.
	//
	// A non-nil error means the outcome of every element is unknown (the
	// reply was lost, or the statement failed as a whole): [ErrUnavailable]
	// and the like, transient as for TryRenew, since repeating a renewal is
	// safe. Otherwise each result says what happened to its lease: renewed
	// (Err nil, Lease with the new deadline and the backend time), lost
	// (Err a [*LostError], as TryRenew), or, for a problem of that element
	// alone (PostgreSQL: its row was locked by another transaction and was
	// skipped rather than waited for), a transient error: the caller renews
	// that lease again on its own, with TryRenew.
	TryRenewBatch(ctx context.Context, reqs []RenewRequest) ([]RenewResult, error)
}

// RenewRequest is one element of [BatchRenewer.TryRenewBatch].
type RenewRequest struct {
	Lease Lease
	TTL   time.Duration
}

// RenewResult is the outcome of one [RenewRequest].
type RenewResult struct {
	// Lease is the renewed lease when Err is nil.
	Lease Lease
	// Err is nil (renewed), a [*LostError] (lost), or a transient error of
	// this element alone.
	Err error
}

// AcquireRequest is the input of [Backend.TryAcquire].
type AcquireRequest struct {
	Key string
	// TTL is the lease duration; see [ValidateTTL].
	TTL time.Duration
	// Owner names the holder (for people and `sqllock list`) and identifies
	// this acquire call: a retry with the same Owner after a lost reply gets
	// its own grant back. The Client makes it unique per acquire call.
	Owner string
	// Value is an opaque value the holder publishes with its lease (an
	// address, a version), at most [MaxValueLen] bytes; nil for none. It is
	// stored with the grant, returned by TryAcquire, List and a refused
	// acquire's [*HeldError], and does not change while the lease is held.
	Value []byte
	// MinHold, when not zero (then within the TTL bounds, [ValidateTTL]),
	// keeps the key held at least until grant time + MinHold by the
	// backend's clock, the grant time being the backend's own clock at
	// the grant, recorded with it:
	//   - the grant's deadline is the later of now + TTL and now +
	//     MinHold, and no renewal moves a deadline before grant + MinHold,
	//     so a holder that crashes keeps the key until the later of its
	//     own deadline and grant + MinHold;
	//   - a Release by the lease's own owner before grant + MinHold
	//     succeeds and leaves the key held, by that owner with the same
	//     token, until grant + MinHold (List shows it so, a refused
	//     acquire's HeldError names it); one after it releases at once;
	//   - a Release by another owner (a forced release) ends the hold at
	//     once, as it ends any lease.
	// No client needs to stay alive or renew for the hold to last. A
	// backend that cannot keep a min hold refuses a request with one,
	// before any I/O, with an error matching [ErrMinHoldUnsupported]:
	// never ignores it.
	MinHold time.Duration

	// Shared asks for a shared grant of Key (many shared holders at once,
	// never beside an exclusive one), under the rules of the package doc's
	// shared locks ([SharedKey], docs/shared-locks.md): the lease's Key is
	// then a reader slot's key. A backend that does not grant shared
	// requests refuses one before any I/O with an error matching
	// [ErrSharedUnsupported] ([AcquireRequest.Validate] does): never takes
	// it as exclusive.
	Shared bool
	// Mark, on an exclusive request, is a waiting acquirer's: when the
	// request is refused, the backend marks Key so that new shared grants
	// are refused until this owner is granted Key or the mark's deadline
	// (now + TTL, by the backend's clock) passes. A backend that grants no
	// shared requests has no readers to keep out and may ignore it.
	Mark bool

	// permits, when not zero, makes the Client send the request as a
	// permit acquire of semaphore Key with that limit ([Client.AcquirePermit]).
	permits int
}

// Lease is one granted lease: plain data, safe to copy.
type Lease struct {
	Key   string
	Token int64 // fencing token, strictly increasing per key
	Owner string
	// Deadline is the lease's deadline as the backend reported it, by the
	// backend's (database) clock.
	Deadline time.Time
	// BackendTime is the backend's clock when it applied the operation.
	// Deadline.Sub(BackendTime) is the TTL it granted.
	BackendTime time.Time
	// Value is the value set at acquire (nil for none). TryRenew returns
	// the value of the lease it was given: a renewal never changes it.
	Value []byte
}

// LockInfo describes one key, as [Backend.List] reports it.
type LockInfo struct {
	Key   string
	Token int64 // the latest token granted for the key
	Owner string
	// Held is true while a lease is held and unexpired by the backend clock.
	Held bool
	// Deadline is the latest lease's deadline by the backend clock.
	Deadline time.Time
	// Remaining is the time left on the lease by the backend clock, 0 when
	// not held.
	Remaining time.Duration
	// Value is the latest grant's value (nil for none); it stays after the
	// lease ends, like Token, until the next grant replaces it.
	Value []byte
	// Shared is the number of shared holders while the key is held
	// shared (Held, Owner empty; each holder is listed under its
	// [SharedKey]), else 0.
	Shared int
	// WaitingWriter is the owner of a live writer's mark on the key
	// (new shared grants are refused), "" for none.
	WaitingWriter string
}

// MultiReleaser is implemented by backends that release a set of leases
// in one round trip: one statement (one commit) on the SQL backends, one
// transaction on etcd. [GuardSet.Release] uses it when the backend has it;
// without it, it releases each member with [Backend.Release], all at once.
//
// A wrapper that embeds a backend to change its Release must change (or
// hide) ReleaseAll too: the embedded one is promoted, and the GuardSet
// would release through it.
type MultiReleaser interface {
	// ReleaseAll releases each ls[i] as Release of it alone would, and
	// returns one answer per lease, in order: the very answer Release
	// would have given it (nil when released, or released before by its
	// own owner; a [*LostError] with the same Reason when the lease was no
	// longer valid: expired, taken by a newer token, or released by
	// another owner), with Release's effects (a release by the lease's
	// own owner inside its min hold keeps the key held until grant +
	// MinHold). An element may also carry a transient error of its own
	// ([ErrUnavailable], [ErrIndeterminate]): repeating the release of
	// that lease is harmless. The keys are written in ascending key
	// order, and the backend waits for a row another transaction locks
	// no longer than Release does.
	//
	// A non-nil error is the call's own failure, for every lease, as
	// Release reports its own: not sent ([ErrUnavailable], the context's
	// error), or [ErrIndeterminate] when the reply was lost (repeating is
	// harmless); no answers then.
	//
	// It validates the set first ([ValidateReleaseAll]) and refuses bad
	// input before any I/O.
	ReleaseAll(ctx context.Context, ls []Lease) ([]error, error)
}
