package mariadb

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ashlock/ashlock/internal/groupcommit"
	"github.com/ashlock/ashlock/internal/keyrange"
	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/internal/wait"
	"github.com/ashlock/ashlock/sqllock"
)

// nowSQL is the database clock (see queries.go).
const nowSQL = `UTC_TIMESTAMP(6)`

// ErrUnsupportedServer is matched by [New]'s error for a server that is
// not MariaDB 10.6 or later (MySQL has no INSERT ... RETURNING).
var ErrUnsupportedServer = errors.New("sqllock/mariadb: MariaDB 10.6 or later required")

// ErrNotDurable is matched by [New]'s error for a server that does not
// write its log to disk at every commit (innodb_flush_log_at_trx_commit
// other than 1), unless [Options.AllowNonDurable].
var ErrNotDurable = errors.New("sqllock/mariadb: the server does not flush its log at every commit (innodb_flush_log_at_trx_commit is not 1)")

// Backend is the MariaDB [sqllock.Backend]. It is safe for concurrent use.
type Backend struct {
	db    *sql.DB
	table string // unquoted, for messages

	// The statements, with the table, clock and lock wait filled in.
	acquireSQL, acquireBatchSQL         string
	renewSQL, renewBatchSQL, releaseSQL string
	releaseHeldSQL, releaseBatchSQL     string
	listSQL, listFromSQL, fenceSQL      string
	reapPickSQL, reapMarkSQL            string
	reapUnmarkSQL, reapDeleteSQL        string // reapDeleteSQL with {{keys}}
	floorSQL                            string

	// floor is the newest floor of reaped keys this Backend has read (0
	// until a first row was refused): acquireSQL's first token is
	// firstToken(floor), and migration 00005's check refuses it when a
	// reap raised the floor since (see acquireSQL).
	floor atomic.Int64

	stmtMu sync.Mutex
	stmts  map[string]*sql.Stmt // prepared lazily (the table may not exist yet)

	closed    atomic.Bool
	deadlocks atomic.Uint64

	// rowRelease (tests) makes Release run releaseSQL alone, so that the
	// conformance suite checks it as a release of its own.
	rowRelease bool

	signals wait.Signals

	// acquireQ and releaseQ coalesce concurrent TryAcquire and Release
	// calls (groupcommit.go); their limit is 0 when group commit is off.
	acquireQ *groupcommit.Queue[sqllock.AcquireRequest, sqllock.Lease]
	releaseQ *groupcommit.Queue[sqllock.Lease, struct{}]
}

var (
	_ sqllock.Backend      = (*Backend)(nil)
	_ sqllock.BatchRenewer = (*Backend)(nil)
	_ sqllock.Watcher      = (*Backend)(nil)
)

// New returns a Backend on the application's database handle, which it
// never closes. It applies no migrations: create the table first (package
// migrations with migrations.MariaDB, or `sqllock migrate up`); until then
// operations fail with [sqllock.ErrSchemaMissing]. It reads the server's
// version and durability once and refuses a server that is not MariaDB
// 10.6 or later ([ErrUnsupportedServer]), or one that does not flush its
// log at every commit unless told to accept it ([ErrNotDurable]).
func New(db *sql.DB, opts Options) (*Backend, error) {
	if db == nil {
		return nil, errors.New("sqllock/mariadb: New: nil *sql.DB")
	}
	o, err := opts.resolve()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var (
		version     string
		flush       int
		sessionWait int64
	)
	if err := db.QueryRowContext(ctx, `SELECT VERSION(), @@GLOBAL.innodb_flush_log_at_trx_commit, @@SESSION.innodb_lock_wait_timeout`).Scan(&version, &flush, &sessionWait); err != nil {
		return nil, fmt.Errorf("sqllock/mariadb: New: %w", classify(ctx, outcome.List, "", err))
	}
	if err := checkVersion(version); err != nil {
		return nil, err
	}
	if flush != 1 && !o.AllowNonDurable {
		return nil, fmt.Errorf("%w: it is %d (set Options.AllowNonDurable to accept grants a machine crash can lose)", ErrNotDurable, flush)
	}
	b := &Backend{db: db, table: o.Table, stmts: make(map[string]*sql.Stmt)}
	limit := groupCommitInFlight
	if o.DisableGroupCommit {
		limit = 0
	}
	b.acquireQ = newQueue(outcome.Acquire, limit, b.sendAcquires)
	b.releaseQ = newQueue(outcome.Release, limit, b.sendReleases)
	t, wait := o.Table, o.lockWaitSeconds()
	prefix := lockWaitPrefix(wait, sessionWait)
	b.acquireSQL = render(acquireSQL, t, nowSQL, prefix)
	b.acquireBatchSQL = render(acquireBatchSQL, t, nowSQL, prefix)
	b.renewSQL = render(renewSQL, t, nowSQL, prefix)
	b.renewBatchSQL = render(renewBatchSQL, t, nowSQL, prefix)
	b.releaseSQL = render(releaseSQL, t, nowSQL, prefix)
	b.releaseBatchSQL = render(releaseBatchSQL, t, nowSQL, prefix)
	b.releaseHeldSQL = render(releaseHeldSQL, t, nowSQL, prefix)
	b.listSQL = render(listSQL, t, nowSQL, prefix)
	b.listFromSQL = render(listFromSQL, t, nowSQL, prefix)
	b.fenceSQL = renderBare(fenceSQL, t, nowSQL)
	b.reapPickSQL = render(reapPickSQL, t, nowSQL, prefix)
	b.reapMarkSQL = render(reapMarkSQL, t, nowSQL, prefix)
	b.reapUnmarkSQL = render(reapUnmarkSQL, t, nowSQL, prefix)
	b.reapDeleteSQL = render(reapDeleteSQL, t, nowSQL, prefix)
	b.floorSQL = render(floorSQL, t, nowSQL, prefix)
	return b, nil
}

// checkVersion refuses a server other than MariaDB 10.6 or later.
func checkVersion(v string) error {
	var major, minor int
	if _, err := fmt.Sscanf(v, "%d.%d", &major, &minor); err != nil || !strings.Contains(v, "MariaDB") {
		return fmt.Errorf("%w: the server says %q", ErrUnsupportedServer, v)
	}
	if major < 10 || major == 10 && minor < 6 {
		return fmt.Errorf("%w: the server says %q", ErrUnsupportedServer, v)
	}
	return nil
}

// Close releases the prepared statements (not the database handle).
// Later calls fail with [sqllock.ErrClosed]. Close does not release
// leases; they expire.
func (b *Backend) Close() error {
	if b.closed.Swap(true) {
		return nil
	}
	b.stmtMu.Lock()
	defer b.stmtMu.Unlock()
	var errs []error
	for _, s := range b.stmts {
		errs = append(errs, s.Close())
	}
	clear(b.stmts)
	return errors.Join(errs...)
}

// Stats are counters for tests and monitoring.
type Stats struct {
	// Deadlocks counts statements InnoDB rolled back as a deadlock's
	// victim (1213), which the backend repeated.
	Deadlocks uint64
}

// Stats returns the backend's counters.
func (b *Backend) Stats() Stats { return Stats{Deadlocks: b.deadlocks.Load()} }

// micros is d in whole microseconds, rounded up; 0 for d <= 0.
func micros(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64((d + time.Microsecond - 1) / time.Microsecond)
}

// leaseMicros is what a statement adds to its now for a lease of d: d in
// whole microseconds, rounded up, and one more, because the clock reads
// whole microseconds, truncated: a deadline is always later than the
// instant the statement ran + d.
func leaseMicros(d time.Duration) int64 { return micros(d) + 1 }

// remaining is how long a lease with deadline has left at least, by a
// clock that read now (Unix µs): one microsecond less (see leaseMicros),
// never below zero.
func remaining(deadline, now int64) time.Duration {
	return time.Duration(max(deadline-now-1, 0)) * time.Microsecond
}

func at(us int64) time.Time { return time.UnixMicro(us) }

// nonEmpty is v, or nil when v holds no byte: no value is nil everywhere.
func nonEmpty(v []byte) []byte {
	if len(v) == 0 {
		return nil
	}
	return v
}

// TryAcquire implements [sqllock.Backend] with one statement (acquireSQL),
// or as a member of a batch (acquireBatchSQL, see groupcommit.go) while
// other acquires of this Backend are in flight.
func (b *Backend) TryAcquire(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	if err := req.Validate(); err != nil {
		return sqllock.Lease{}, err
	}
	if b.acquireQ.Limit == 0 {
		return b.tryAcquire(ctx, req)
	}
	if b.closed.Load() {
		return sqllock.Lease{}, errClosed
	}
	if err := ctx.Err(); err != nil {
		return sqllock.Lease{}, dialect.NotSent(outcome.Acquire, req.Key, true, err)
	}
	return b.acquireQ.Do(ctx, req.Key, 0, req, func(ctx context.Context) (sqllock.Lease, error) {
		return b.tryAcquire(ctx, req)
	})
}

// acquireRow is what acquireSQL returns, and acquireBatchSQL for each key.
type acquireRow struct {
	token, deadline, now int64
	held, kept           bool
	owner                string
	value                []byte
}

// acquireParams are an acquire's arguments, in µs.
type acquireParams struct {
	lease, hold int64
	value       any // NULL for no value
}

func acquireArgs(req sqllock.AcquireRequest) acquireParams {
	var p acquireParams
	if len(req.Value) > 0 {
		p.value = req.Value
	}
	if req.MinHold > 0 {
		p.hold = leaseMicros(req.MinHold)
	}
	p.lease = max(leaseMicros(req.TTL), p.hold)
	return p
}

// tryAcquire sends req alone, with acquireSQL. A first row the floor
// refused (isFloorRace: a reap raised it since this Backend read it)
// applied nothing: the floor is read again (readFloor) and run sends the
// statement again with the new first token.
func (b *Backend) tryAcquire(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	p := acquireArgs(req)
	var r acquireRow
	err := b.run(ctx, outcome.Acquire, req.Key, func(ctx context.Context) error {
		first := firstToken(b.floor.Load())
		_, err := b.queryRow(ctx, b.acquireSQL, []any{req.Key, first, p.lease, req.Owner, p.value, p.hold, p.hold},
			&r.token, &r.held, &r.deadline, &r.owner, &r.value, &r.now, &r.kept)
		if isFloorRace(err) {
			if ferr := b.readFloor(ctx); ferr != nil {
				return ferr
			}
		}
		return err
	})
	if err != nil {
		return sqllock.Lease{}, err
	}
	return acquired(req, r)
}

// firstToken is a key's first token above floor: floor + 1, or floor at
// the largest token (firstSQL's rule), where migration 00005's check
// refuses the row (ErrTokenExhausted) and an existing key's acquire, which
// never uses it, still works.
func firstToken(floor int64) int64 {
	if floor < math.MaxInt64 {
		return floor + 1
	}
	return floor
}

// readFloor reads the newest committed floor of reaped keys into b.floor,
// which never goes down.
func (b *Backend) readFloor(ctx context.Context) error {
	var f int64
	if _, err := b.queryRow(ctx, b.floorSQL, nil, &f); err != nil {
		return err
	}
	for {
		cur := b.floor.Load()
		if f <= cur || b.floor.CompareAndSwap(cur, f) {
			return nil
		}
	}
}

// acquired is req's answer from its row after the statement: the single
// statement's and a batch's alike.
func acquired(req sqllock.AcquireRequest, r acquireRow) (sqllock.Lease, error) {
	switch {
	case r.held && r.deadline > r.now && r.owner == req.Owner:
		return sqllock.Lease{
			Key: req.Key, Token: r.token, Owner: r.owner,
			Deadline: at(r.deadline), BackendTime: at(r.now), Value: nonEmpty(r.value),
		}, nil
	case (r.held || r.kept) && r.deadline > r.now: // kept: released inside its min hold
		return sqllock.Lease{}, &sqllock.HeldError{
			Key: req.Key, Owner: r.owner, Token: r.token,
			Remaining: remaining(r.deadline, r.now), Value: nonEmpty(r.value),
		}
	case r.token == math.MaxInt64:
		return sqllock.Lease{}, fmt.Errorf("%w: key %q", sqllock.ErrTokenExhausted, req.Key)
	}
	return sqllock.Lease{}, fmt.Errorf("sqllock/mariadb: TryAcquire %q: unexpected row (token %d, held %v, deadline %d, now %d)",
		req.Key, r.token, r.held, r.deadline, r.now)
}

// TryRenew implements [sqllock.Backend] with one statement (renewSQL),
// renewed or not.
func (b *Backend) TryRenew(ctx context.Context, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
	if err := sqllock.ValidateLease(l); err != nil {
		return sqllock.Lease{}, err
	}
	if err := sqllock.ValidateTTL(ttl); err != nil {
		return sqllock.Lease{}, err
	}
	var (
		found, held          bool
		token, deadline, now int64
	)
	err := b.run(ctx, outcome.Renew, l.Key, func(ctx context.Context) (err error) {
		found, err = b.queryRow(ctx, b.renewSQL, []any{l.Key, l.Token, leaseMicros(ttl), l.Key}, &token, &held, &deadline, &now)
		return err
	})
	if err != nil {
		return sqllock.Lease{}, err
	}
	if found && token == l.Token && held && deadline > now {
		l.Deadline, l.BackendTime = at(deadline), at(now)
		return l, nil
	}
	st := sqllock.KeyState{Found: found, Token: token, Held: held, Expired: deadline <= now}
	if lost := st.Loss(l); lost != nil {
		return sqllock.Lease{}, lost
	}
	return sqllock.Lease{}, fmt.Errorf("sqllock/mariadb: TryRenew %q: unexpected row (token %d, held %v, deadline %d, now %d)",
		l.Key, token, held, deadline, now)
}

// Release implements [sqllock.Backend]: one statement (releaseHeldSQL)
// when the lease was held and unexpired, or a member of a batch
// (releaseBatchSQL, see groupcommit.go) while other releases of this
// Backend are in flight; otherwise one more (releaseSQL),
// which clears an expired lease, and tells "released twice" by its owner
// (nil) from a release by someone else, a newer token or an unknown one
// (a [*sqllock.LostError]).
func (b *Backend) Release(ctx context.Context, l sqllock.Lease) error {
	if err := sqllock.ValidateLease(l); err != nil {
		return err
	}
	if b.rowRelease {
		return b.releaseRow(ctx, l)
	}
	if b.releaseQ.Limit == 0 {
		return b.release(ctx, l)
	}
	if b.closed.Load() {
		return errClosed
	}
	if err := ctx.Err(); err != nil {
		return dialect.NotSent(outcome.Release, l.Key, true, err)
	}
	_, err := b.releaseQ.Do(ctx, l.Key, 0, l, func(ctx context.Context) (struct{}, error) {
		return struct{}{}, b.release(ctx, l)
	})
	return err
}

// release sends l's release alone: releaseHeldSQL, and releaseSQL when
// that cleared nothing.
func (b *Backend) release(ctx context.Context, l sqllock.Lease) error {
	var n int64
	err := b.run(ctx, outcome.Release, l.Key, func(ctx context.Context) error {
		s, err := b.stmt(ctx, b.releaseHeldSQL)
		if err != nil {
			return err
		}
		res, err := s.ExecContext(ctx, l.Owner, l.Owner, l.Owner, l.Key, l.Token)
		if err != nil {
			return err
		}
		n, err = res.RowsAffected()
		return err
	})
	if err != nil {
		return err
	}
	if n == 1 {
		b.signals.Signal(l.Key)
		return nil
	}
	return b.releaseRow(ctx, l)
}

// releaseRow is Release with releaseSQL alone.
func (b *Backend) releaseRow(ctx context.Context, l sqllock.Lease) error {
	var r releaseResult
	err := b.run(ctx, outcome.Release, l.Key, func(ctx context.Context) (err error) {
		r.found, err = b.queryRow(ctx, b.releaseSQL, []any{l.Key, l.Token, l.Owner, l.Key},
			&r.token, &r.held, &r.owner, &r.deadline, &r.now, &r.cleared, &r.expired)
		return err
	})
	if err != nil {
		return err
	}
	return b.released(l, r)
}

// releaseResult is what releaseSQL returns, and releaseBatchSQL for each
// key; found is false when the key has no row.
type releaseResult struct {
	found            bool
	token            int64
	held             bool
	owner            string
	deadline, now    int64
	cleared, expired sql.NullBool
}

// released is l's release's answer from its row after releaseSQL or
// releaseBatchSQL, and signals a clearing to the process's waiters.
func (b *Backend) released(l sqllock.Lease, r releaseResult) error {
	st := sqllock.KeyState{Found: r.found, Token: r.token, Held: r.held, Owner: r.owner, Expired: r.deadline <= r.now}
	if st.Found && r.cleared.Bool {
		b.signals.Signal(l.Key)
		if r.expired.Bool {
			return &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostExpired}
		}
		return nil
	}
	if st.ReleasedByOwner(l) {
		return nil // released twice by its owner
	}
	if lost := st.Loss(l); lost != nil {
		return lost
	}
	return fmt.Errorf("sqllock/mariadb: Release %q: unexpected row (token %d, held %v, deadline %d, now %d)",
		l.Key, st.Token, st.Held, r.deadline, r.now)
}

// List implements [sqllock.Backend] with one read (an index range on the
// key, no LIKE).
func (b *Backend) List(ctx context.Context, prefix string) ([]sqllock.LockInfo, error) {
	if err := sqllock.ValidatePrefix(prefix); err != nil {
		return nil, err
	}
	query, args := b.listFromSQL, []any{prefix}
	if end, ok := keyrange.PrefixEnd(prefix); ok {
		query, args = b.listSQL, []any{prefix, end}
	}
	var out []sqllock.LockInfo
	err := b.run(ctx, outcome.List, prefix, func(ctx context.Context) error {
		out = out[:0]
		s, err := b.stmt(ctx, query)
		if err != nil {
			return err
		}
		rows, err := s.QueryContext(ctx, args...)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var (
				i             sqllock.LockInfo
				deadline, now int64
			)
			if err := rows.Scan(&i.Key, &i.Token, &i.Owner, &i.Held, &deadline, &now, &i.Value); err != nil {
				return err
			}
			i.Value = nonEmpty(i.Value)
			i.Deadline = at(deadline)
			if i.Held {
				i.Remaining = remaining(deadline, now)
			}
			out = append(out, i)
		}
		if err := rows.Err(); err != nil {
			return err
		}
		return rows.Close()
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}
