package postgres

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ashlock/ashlock/internal/groupcommit"
	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// Backend is the PostgreSQL [sqllock.Backend] and [sqllock.Watcher]. It is
// safe for concurrent use. Close it to stop its listener; it never closes the
// pool.
type Backend struct {
	pool   *pgxpool.Pool // the application's (New); never closed here
	table  string        // quoted, for messages
	notify bool
	log    *slog.Logger

	// db is the application's *sql.DB instead of pool (NewDB; sqldb.go),
	// never closed here. pgxDriver: db's driver is pgx's stdlib, whose
	// connections reach a *pgx.Conn; listen: Watch listens (pgx's stdlib
	// driver only: on other drivers waiters poll).
	db        *sql.DB
	pgxDriver bool
	libpq     bool // db's driver is lib/pq (the pooler check, sqldb.go)
	listen    bool
	// prepared keeps lib/pq's statements prepared per connection
	// (prepared.go), nil when statements go unnamed (other drivers,
	// Options.UnnamedStatements); they go prepared once the pooler check
	// found a direct connection (namedOK).
	prepared *stmtCache
	namedOK  atomic.Bool

	// full are the statements at the latest schema version, rendered by
	// New: those that use no column of a later migration (renew, fence,
	// ...) are taken from it at once. stmts are the statements for the
	// table's version, set once by the first statement that needs them
	// (queries.go); schemaSem lets one caller at a time read the version.
	full      *statements
	stmts     atomic.Pointer[statements]
	permit    permitStatements // the semaphore's (permit.go), at the latest version
	schemaSem chan struct{}

	// acquireQ and releaseQ coalesce concurrent TryAcquire and Release
	// calls (batch.go); their limit is 0 when group commit is off.
	acquireQ *groupcommit.Queue[sqllock.AcquireRequest, sqllock.Lease]
	releaseQ *groupcommit.Queue[sqllock.Lease, struct{}]
	// permitQ coalesces concurrent TryAcquirePermit calls (permit.go),
	// keyed by semaphore and owner.
	permitQ *groupcommit.Queue[sqllock.PermitRequest, sqllock.Lease]
	// setQ coalesces concurrent TryAcquireAll calls (multi.go); a
	// member's size is its number of keys.
	setQ *groupcommit.Queue[setCall, []sqllock.Lease]

	beforeRacePeek func() // tests: runs before releaseRaced reads the row

	conflictRetries atomic.Int64 // statements sent again after a conflict (tests)

	// poolerCheck is what the first statement learned about a pooler in
	// between (pooler.go).
	poolerCheck pooler

	// watches counts the watches in progress (Watch calls not yet ended):
	// while it is 0, TryAcquire knows without a lock that no key is watched.
	watches atomic.Int64

	// listenIdle and listenPing bound how long a half-open listening
	// connection goes unnoticed (watch.go); tests shorten them.
	listenIdle, listenPing time.Duration

	// aside renews and releases leases on a connection of its own while
	// the pool's connections do not answer (aside.go).
	aside aside

	mu       sync.Mutex
	closed   bool
	listener *listener // started by the first Watch
}

var (
	_ sqllock.Backend      = (*Backend)(nil)
	_ sqllock.Watcher      = (*Backend)(nil)
	_ sqllock.BatchRenewer = (*Backend)(nil)
)

// pg is the prefix of this package's errors.
const pg = outcome.Dialect("sqllock/postgres")

// New returns a Backend that keeps its locks in the table named by opts, on
// pool. It does no I/O: the first statement reads the table's schema
// version (a missing table is reported as [sqllock.ErrSchemaMissing]). The
// pool stays the caller's: Close does not close it, and it must outlive the
// Backend.
func New(pool *pgxpool.Pool, opts Options) (*Backend, error) {
	if pool == nil {
		return nil, errors.New("sqllock/postgres: nil pool")
	}
	b, err := newBackend(opts)
	if err != nil {
		return nil, err
	}
	b.pool = pool
	b.listen = b.notify
	return b, nil
}

// newBackend is the Backend that opts describe, on no pool yet.
func newBackend(opts Options) (*Backend, error) {
	table, err := opts.quotedTable()
	if err != nil {
		return nil, err
	}
	b := &Backend{
		table:     table,
		notify:    !opts.DisableNotify,
		log:       cmpLogger(opts.Logger),
		full:      render(schema{Table: table, Version: latest, Notify: !opts.DisableNotify, DurableRelease: opts.DurableRelease}),
		schemaSem: make(chan struct{}, 1),

		listenIdle: listenIdle,
		listenPing: listenPing,
	}
	b.permit = renderPermit(table, !opts.DisableNotify)
	limit := groupCommitInFlight
	if opts.DisableGroupCommit {
		limit = 0
	}
	b.acquireQ = newQueue(outcome.Acquire, limit, b.sendAcquires)
	b.releaseQ = newQueue(outcome.Release, limit, b.sendReleases)
	b.permitQ = newQueue(outcome.Acquire, limit, b.sendPermits)
	b.permitQ.MaxSize = maxPermitRows
	b.setQ = newQueue(outcome.Acquire, limit, b.sendSets)
	b.setQ.MaxSize = maxBatch
	return b, nil
}

// Close stops the listener and waits for it to end; it does not close the
// pool. Watch channels stop firing. It is safe to call more than once. Other
// methods keep working after Close.
func (b *Backend) Close() error {
	b.mu.Lock()
	b.closed = true
	l := b.listener
	b.listener = nil
	b.mu.Unlock()
	if l != nil {
		l.stop()
	}
	b.aside.close()
	return nil
}

// TryAcquire implements [sqllock.Backend.TryAcquire] in one statement (see
// queries/acquire.sql). A refusal reports the holder, its token and remaining time by
// the database clock, read in the same round trip; when two first acquires
// of a new key race, or the row changed while the statement ran, the loser's
// [*sqllock.HeldError] has no owner and zero Remaining (try again at once).
//
// A context that ends while the statement is in flight, or a connection
// that breaks after it was sent, gives an error matching
// [sqllock.ErrIndeterminate] (and [sqllock.ErrUnavailable] for the broken
// connection): the grant may have committed, and repeating the same request
// (same Owner) returns it. So does a grant that the server answered as
// committed when the context had ended meanwhile, or with a WARNING (seen
// with [OnNotice]): its wait for the synchronous standbys may have been
// cancelled, and a failover could lose it (see Durability in the package
// doc).
//
// While the key is watched ([Backend.Watch], as a client's Acquire does
// while it waits), an attempt that finds the key held by another owner
// also marks the lease, once per tenure, so that its release notifies; a
// release that nobody marked sends no notification. Unwatched, a refused
// attempt writes nothing.
func (b *Backend) TryAcquire(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	if req.Shared {
		return b.tryAcquireShared(ctx, req)
	}
	if err := req.Validate(); err != nil {
		return sqllock.Lease{}, err
	}
	if err := ctx.Err(); err != nil {
		return sqllock.Lease{}, pg.NotSent(outcome.Acquire, req.Key, true, err)
	}
	watched := b.watched(req.Key)
	if watched || req.Mark || b.acquireQ.Limit == 0 {
		return b.tryAcquire(ctx, req, watched)
	}
	return b.acquireQ.Do(ctx, req.Key, 0, req, func(ctx context.Context) (sqllock.Lease, error) {
		return b.tryAcquire(ctx, req, false)
	})
}

// tryAcquire sends req alone, in the waiting form when watched.
func (b *Backend) tryAcquire(ctx context.Context, req sqllock.AcquireRequest, watched bool) (sqllock.Lease, error) {
	st, err := b.statements(ctx, outcome.Acquire, req.Key)
	if err != nil {
		return sqllock.Lease{}, err
	}
	if err := st.lacks(b.table, len(req.Value) > 0, req.MinHold != 0); err != nil {
		return sqllock.Lease{}, err
	}
	q := st.acquire
	switch {
	case watched && req.Mark:
		q = st.acquireMarkWait
	case req.Mark:
		q = st.acquireMark
	case watched:
		q = st.acquireWait
	}
	args := []any{req.Key, leaseMicros(req.TTL), req.Owner}
	if st.value {
		args = append(args, nonEmpty(req.Value)) // nil: NULL
	}
	if st.hold {
		args = append(args, holdMicros(req.MinHold))
	}
	var r acquireRow
	err = b.queryRow(ctx, q, args, &r.granted, &r.token, &r.deadline, &r.held, &r.owner, &r.now, &r.changed, &r.value, &r.shared, &r.waiting)
	if err != nil {
		return sqllock.Lease{}, b.translate(ctx, outcome.Acquire, req.Key, err)
	}
	return acquired(req, r)
}

// TryRenew implements [sqllock.Backend.TryRenew] in one statement. A miss is
// a [*sqllock.LostError] whose reason comes from the same round trip. A
// renew of unknown outcome (context ended or connection broke in flight) is
// [sqllock.ErrUnavailable]: repeating it is safe.
func (b *Backend) TryRenew(ctx context.Context, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
	if err := sqllock.ValidateLease(l); err != nil {
		return sqllock.Lease{}, err
	}
	if err := sqllock.ValidateTTL(ttl); err != nil {
		return sqllock.Lease{}, err
	}
	if err := ctx.Err(); err != nil {
		return sqllock.Lease{}, pg.NotSent(outcome.Renew, l.Key, true, err)
	}
	if key, _, ok := sqllock.ParseSharedKey(l.Key); ok {
		return b.renewShared(ctx, l, key, ttl)
	}
	var (
		renewed, held bool
		current       int64
		deadline, now time.Time
	)
	err := b.queryRowVia(ctx, sendOpts{pooler: true, aside: true}, b.full.renew, []any{l.Key, l.Token, leaseMicros(ttl)},
		&renewed, &deadline, &current, &held, &now)
	if errors.Is(err, pgx.ErrNoRows) {
		return sqllock.Lease{}, lostReason(l, 0, false, deadline, now) // no row
	}
	if err != nil {
		return sqllock.Lease{}, b.translate(ctx, outcome.Renew, l.Key, err)
	}
	if !renewed {
		return sqllock.Lease{}, lostReason(l, current, held, deadline, now)
	}
	l.Deadline = deadline
	l.BackendTime = now
	return l, nil
}

// Release implements [sqllock.Backend.Release] in one statement, which also
// notifies watchers (unless [Options.DisableNotify]) when it released a row.
// Errors are as for TryAcquire: an in-flight failure is
// [sqllock.ErrIndeterminate], and repeating the release is harmless.
//
// The release commits asynchronously (synchronous_commit off for its own
// transaction only): if the server crashes within a few hundred milliseconds
// after it, the lease may come back and last until its deadline, as a
// crashed holder's would. Tokens and grants stay durable, and a later grant
// of the key flushes the release before it commits. See queries/release.sql.
func (b *Backend) Release(ctx context.Context, l sqllock.Lease) error {
	if err := sqllock.ValidateLease(l); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return pg.NotSent(outcome.Release, l.Key, true, err)
	}
	if key, _, ok := sqllock.ParseSharedKey(l.Key); ok {
		return b.releaseShared(ctx, l, key)
	}
	if b.releaseQ.Limit == 0 {
		return b.releaseAlone(ctx, l)
	}
	_, err := b.releaseQ.Do(ctx, l.Key, 0, l, func(ctx context.Context) (struct{}, error) {
		return struct{}{}, b.releaseAlone(ctx, l)
	})
	return err
}

// releaseAlone sends l's release alone.
func (b *Backend) releaseAlone(ctx context.Context, l sqllock.Lease) error {
	for range 3 {
		err := b.release(ctx, l)
		if err != errRaced {
			return err
		}
	}
	// Re-granted to l's owner each time before the release could apply:
	// its acquire keeps being retried. Report it as transient.
	return fmt.Errorf("sqllock/postgres: %s %q: %w: the lease was re-granted to its owner before each of 3 release attempts applied",
		outcome.Release, l.Key, sqllock.ErrUnavailable)
}

func (b *Backend) release(ctx context.Context, l sqllock.Lease) error {
	var (
		released, valid, held bool
		current, notified     int64
		deadline, now         time.Time
		owner                 string
	)
	st, err := b.statements(ctx, outcome.Release, l.Key)
	if err != nil {
		return err
	}
	err = b.queryRowVia(ctx, sendOpts{pooler: true, aside: true}, st.release, []any{l.Key, l.Token, l.Owner},
		&released, &valid, &current, &held, &deadline, &owner, &now, &notified)
	if errors.Is(err, pgx.ErrNoRows) {
		return releasedLost(l, false, 0, false, "") // the key has no row
	}
	if err != nil {
		return b.translate(ctx, outcome.Release, l.Key, err)
	}
	switch {
	case released && valid:
		return nil
	case released:
		return &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostExpired}
	case current == l.Token && held && deadline.After(now):
		// Held and valid in the snapshot, yet not released by this
		// statement: a concurrent change won the row (a release, or a
		// takeover once the deadline passed). Only a fresh read tells
		// which; this second round trip happens in that race alone.
		return b.releaseRaced(ctx, l)
	case current == l.Token && held:
		// Expired in the snapshot and changed meanwhile (released, or
		// taken over): either way it had expired.
		return &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostExpired}
	}
	return releasedLost(l, current > 0, current, held, owner)
}

// releaseRaced reads the row after a Release lost the race for it. The
// release did nothing, so a failed read only leaves the answer unknown.
func (b *Backend) releaseRaced(ctx context.Context, l sqllock.Lease) error {
	var (
		token         int64
		held          bool
		deadline, now time.Time
		owner         string
	)
	if b.beforeRacePeek != nil {
		b.beforeRacePeek()
	}
	err := b.queryRow(ctx, b.full.peek, []any{l.Key}, &token, &held, &deadline, &owner, &now)
	if errors.Is(err, pgx.ErrNoRows) {
		return releasedLost(l, false, 0, false, "")
	}
	if err != nil {
		return b.translate(ctx, outcome.Release, l.Key, err)
	}
	return releasedLost(l, true, token, held, owner)
}

// List implements [sqllock.Backend.List]. The prefix is compared literally
// (no LIKE patterns); keys come in byte order, as Go sorts strings. An
// empty prefix lists every key.
func (b *Backend) List(ctx context.Context, prefix string) ([]sqllock.LockInfo, error) {
	if err := sqllock.ValidatePrefix(prefix); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, pg.NotSent(outcome.List, prefix, true, err)
	}
	st, err := b.statements(ctx, outcome.List, prefix)
	if err != nil {
		return nil, err
	}
	var out []sqllock.LockInfo
	list := func() error {
		out = out[:0]
		var i sqllock.LockInfo
		var now time.Time
		return b.listRows(ctx, st.list, prefix, []any{&i.Key, &i.Token, &i.Owner, &i.Held, &i.Deadline, &now, &i.Value, &i.Shared, &i.WaitingWriter}, func() error {
			i.Remaining = 0
			if i.Held {
				i.Remaining = i.Deadline.Sub(now)
			}
			i.Value = nonEmpty(i.Value)
			out = append(out, i)
			i.Value = nil // scanned fresh for the next row
			return nil
		})
	}
	// A read-only statement too can fail with a serialization failure.
	if err := b.retryConflicts(ctx, list); err != nil {
		return nil, b.translate(ctx, outcome.List, prefix, err)
	}
	return out, nil
}
