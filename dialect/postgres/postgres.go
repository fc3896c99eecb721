// Package postgres is the PostgreSQL [sqllock.Backend], on the application's
// own [*pgxpool.Pool] (github.com/jackc/pgx/v5).
//
// The lock table is created by the migrations package (or `sqllock migrate
// up`): one row per key with its latest fencing token, whether it is held,
// its deadline by the database clock and its owner. TryAcquire, TryRenew and
// Release are each one statement and one round trip; the database clock
// (statement_timestamp(), read once per statement) alone decides expiry. A TryAcquire that finds the key
// held locks no row, assigns no transaction id and writes no WAL of its own
// (its read may prune dead row versions that renewals left on the page:
// about one record of ~270 bytes per hundred renewals), so waiters that poll
// a hot key cost the database little. A Release needs no
// durability and commits without waiting for its WAL flush.
//
// Close the Backend (which stops its listener) before closing the pool.
//
// The Backend also implements [sqllock.Watcher] with LISTEN/NOTIFY on one
// shared connection (see [Options.DisableNotify] for PgBouncer in transaction
// mode), and [Backend.FencedTx] runs a transaction in the same database that
// commits only while a lease is held. A release notifies only when a waiter
// marked the lease: while a key is watched, the first refused attempt of a
// tenure sets the row's "waited" column (migration 00003), once; a
// TryAcquire that does not wait never writes. On a table that lacks the
// column the Backend falls back to notifying every release.
//
// # Durability
//
// Grants and renewals commit with synchronous_commit at least on, whatever
// the session, role or database says: where it is off or local, the
// statement raises it to on for its own transaction (and so waits for
// synchronous standbys where the server has them); remote_write, on and
// remote_apply are kept. An acknowledged grant therefore survives a server
// crash, and the next grant's token is greater (G2). This needs the server
// to flush for real: with fsync=off a crash can lose acknowledged grants
// and hand a token out twice, and nothing a client does can prevent it.
// Releases commit asynchronously unless [Options.DurableRelease].
//
// With synchronous standbys, an acknowledged grant or renewal is on a
// standby too, and survives a failover to it. The exception is a commit
// whose wait for the standbys is cancelled (a cancel request when a
// caller's context ends, or an operator's pg_cancel_backend): PostgreSQL
// keeps the local commit, sends a WARNING and answers as for a success. A
// statement that succeeded after its context ended, or with a WARNING, is
// therefore reported as of unknown outcome: [sqllock.ErrIndeterminate] for
// grants (and releases, and FencedTx commits), [sqllock.ErrUnavailable]
// for renewals. pgx hands the WARNING to the pool's ConnConfig.OnNotice
// alone: install [OnNotice] there to have an operator's cancel seen too.
//
// # Isolation levels and failover
//
// Where sessions default to REPEATABLE READ or SERIALIZABLE
// (default_transaction_isolation in the DSN, the role or the database), a
// contended statement may fail with a serialization failure (or, like any
// statement, a deadlock); the server rolled it back, and the backend sends
// it again, a few times with a short jittered pause, before it reports
// [sqllock.ErrUnavailable]. A connection on which the server answers that it
// is read-only (a primary demoted by a failover, or a hot standby) or
// shutting down is closed rather than returned to the pool, so that the next
// operation dials anew and can reach the new primary; the operation that met
// it fails with [sqllock.ErrUnavailable], not applied. Neither costs a round
// trip when it does not happen.
//
// # Poolers
//
// Behind PgBouncer in transaction mode (or any pooler that gives a client
// a server connection for one transaction at a time) two things need a
// session, and so need settings:
//   - pgx's default QueryExecModeCacheStatement prepares named statements
//     on whichever server connection it has; set default_query_exec_mode=exec
//     in the connection string (or cache_describe, or simple_protocol), unless
//     PgBouncer (1.21 or later) has max_prepared_statements > 0;
//   - LISTEN: set [Options.DisableNotify] (waiters then poll).
//
// The backend keeps no other session state: statements are single, each in
// its own transaction, and [Backend.FencedTx] is one transaction. The first
// statement checks whether such a pooler is in between while these settings
// are wrong, and if so every statement fails with [ErrPoolerSettings],
// which says what to set (see ErrPoolerSettings for what the check can and
// cannot see). Session pooling needs nothing: everything works,
// notifications included.
package postgres

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ashlock/ashlock/internal/sqlident"
	"github.com/ashlock/ashlock/sqllock"
)

// DefaultTable is the lock table's name when [Options.Table] is empty.
const DefaultTable = "sqllock_locks"

// Options configure a [Backend]. The zero value is the default.
type Options struct {
	// Schema holds the lock table. Empty means the connection's search_path
	// decides. It must be a plain identifier (ASCII letters, digits and _,
	// not starting with a digit, at most 63 bytes); it is quoted in SQL.
	Schema string

	// Table is the lock table's name, [DefaultTable] when empty. Same rules
	// as Schema, but at most 55 bytes: the migrations name its version table
	// "<Table>_version", and New refuses what could never be migrated.
	Table string

	// DisableNotify turns off LISTEN/NOTIFY: Release sends no notification
	// and [Backend.Watch] returns a channel that never fires, so waiting
	// clients find a released key by polling. Set it behind PgBouncer in
	// transaction mode (or any pooler that does not keep a session; see
	// Poolers in the package doc).
	DisableNotify bool

	// DurableRelease makes Release commit synchronously, like grants and
	// renewals (at least synchronous_commit=on, whatever the session says).
	// By default a release commits asynchronously: it needs no durability
	// (lost in a server crash, the lease just ends at its deadline, as a
	// crashed holder's would; grants and renewals stay durable, and any
	// later grant of the key flushes the release first), and it saves one
	// WAL flush per acquire/release pair. A durable release that notifies a
	// waiter holds PostgreSQL's global NOTIFY lock until its WAL flush, so
	// concurrent notifying releases serialize on the disk; releases that
	// nobody waits for send no notification and do not. Set it where a
	// server crash must not delay the next holder by up to one TTL.
	DurableRelease bool

	// DisableGroupCommit turns off the client-side group commit: by
	// default, TryAcquire and Release calls that arrive while four
	// statements of their kind are already in flight from this Backend
	// wait for one of them to end and then go together, many keys in one
	// statement and one commit (a busy process makes many grants per WAL
	// flush). A call that finds fewer in flight is sent at once, alone,
	// as without it, so an idle process sees no change. Per-key answers
	// are the same either way; see TryAcquire and Release.
	DisableGroupCommit bool

	// Logger receives the listener's connection problems. Nil discards.
	Logger *slog.Logger
}

// Backend is the PostgreSQL [sqllock.Backend] and [sqllock.Watcher]. It is
// safe for concurrent use. Close it to stop its listener; it never closes the
// pool.
type Backend struct {
	pool   *pgxpool.Pool // the application's; never closed here
	table  string        // quoted, for messages
	notify bool
	log    *slog.Logger

	// The statements, with the table filled in.
	renewSQL, renewBatchSQL, peekSQL, fenceSQL, channelSQL string
	// The group commit's batch statements (groupcommit.go), in the forms
	// with every column (b.full).
	acquireBatchSQL, releaseBatchSQL string

	// acquireQ and releaseQ coalesce concurrent TryAcquire and Release
	// calls (groupcommit.go); their limit is 0 when group commit is off.
	acquireQ *gcQueue[sqllock.AcquireRequest, sqllock.Lease]
	releaseQ *gcQueue[sqllock.Lease, struct{}]
	// stmts are the statements that use the columns of migrations 00003
	// ("waited"), 00004 ("value") and 00005 ("hold_until"), or, once a
	// statement met a table without them, their forms without (see
	// withStatements): full has every column, marked all but hold_until,
	// noValue only waited, legacy none.
	stmts                         atomic.Pointer[markStatements]
	full, marked, noValue, legacy *markStatements

	beforeRacePeek func() // tests: runs before releaseRaced reads the row

	conflictRetries atomic.Int64 // statements sent again after a conflict (tests)

	// poolerCheck is what the first statement learned about a pooler in
	// between (pooler.go).
	poolerCheck pooler

	// watches counts the watches in progress (Watch calls not yet ended):
	// while it is 0, TryAcquire knows without a lock that no key is watched.
	watches atomic.Int64

	// listenIdle and listenPing bound how long a half-open listening
	// connection goes unnoticed (listener.go); tests shorten them.
	listenIdle, listenPing time.Duration

	// aside renews and releases leases on a connection of its own while
	// the pool's connections do not answer (aside.go).
	aside aside

	mu       sync.Mutex
	closed   bool
	listener *listener // started by the first Watch
}

// markStatements are the statements that read or write the columns added
// after 00002: acquire is acquireSQL, acquireWait its waiting form, which
// marks a held row for its release to notify (TryAcquire sends it while the
// key is watched), release is releaseSQL and list listSQL. waited, value
// and hold tell which columns they use.
type markStatements struct {
	acquire, acquireWait, release, list string
	waited, value, hold                 bool
}

var (
	_ sqllock.Backend      = (*Backend)(nil)
	_ sqllock.Watcher      = (*Backend)(nil)
	_ sqllock.BatchRenewer = (*Backend)(nil)
)

// New returns a Backend that keeps its locks in the table named by opts, on
// pool. It does no I/O: a missing table is reported by the first operation
// as [sqllock.ErrSchemaMissing]. The pool stays the caller's: Close does not
// close it, and it must outlive the Backend.
func New(pool *pgxpool.Pool, opts Options) (*Backend, error) {
	if pool == nil {
		return nil, errors.New("sqllock/postgres: nil pool")
	}
	table := opts.Table
	if table == "" {
		table = DefaultTable
	}
	if err := sqlident.ValidateTable(table); err != nil {
		return nil, fmt.Errorf("sqllock/postgres: table: %w", err)
	}
	if opts.Schema != "" {
		if err := sqlident.Validate(opts.Schema); err != nil {
			return nil, fmt.Errorf("sqllock/postgres: schema: %w", err)
		}
	}
	quoted := sqlident.QuotePostgres(opts.Schema, table)
	logger := opts.Logger
	if logger == nil {
		logger = slog.New(slog.DiscardHandler)
	}
	b := &Backend{
		pool:   pool,
		table:  quoted,
		notify: !opts.DisableNotify,
		log:    logger,

		listenIdle: listenIdle,
		listenPing: listenPing,
	}
	releaseCommit := "set_config('synchronous_commit', 'off', true)"
	if opts.DurableRelease {
		releaseCommit = durableSQL
	}
	notify := "0"
	if b.notify {
		notify = notifySQL
	}
	fill := func(q string) string {
		q = strings.ReplaceAll(q, "{{notify}}", notify)
		q = strings.ReplaceAll(q, "{{release_commit}}", releaseCommit)
		q = strings.ReplaceAll(q, "{{durable}}", durableSQL)
		q = strings.ReplaceAll(q, "{{table}}", quoted)
		// A quoted, validated name holds no single quote: as a string
		// literal (for ::regclass) it needs no escaping.
		return strings.ReplaceAll(q, "{{table_literal}}", "'"+quoted+"'")
	}
	forms := func(waited, value, hold bool) *markStatements {
		setWaited, waitedCol := setWaitedSQL, waitedSQL
		if !waited {
			setWaited, waitedCol = legacySetWaited, legacyWaited
		}
		valueParts := strings.NewReplacer("{{set_value}}", setValueSQL, "{{value_column}}", valueColumnSQL,
			"{{value_arg}}", valueArgSQL, "{{holder_value}}", holderValueSQL, "{{list_value}}", listValueSQL)
		if !value {
			valueParts = strings.NewReplacer("{{set_value}}", "", "{{value_column}}", "",
				"{{value_arg}}", "", "{{holder_value}}", noValueSQL, "{{list_value}}", noValueSQL)
		}
		holdParts := strings.NewReplacer("{{grant_micros}}", grantMicrosSQL, "{{set_hold}}", setHoldSQL,
			"{{hold_passed}}", holdPassedSQL, "{{hold_column}}", holdColumnSQL, "{{hold_arg}}", holdArgSQL,
			"{{taken}}", takenSQL, "{{release_hold}}", releaseHoldSQL, "{{list_taken}}", listTakenSQL)
		if !hold {
			holdParts = strings.NewReplacer("{{grant_micros}}", noHoldGrantMicros, "{{set_hold}}", "",
				"{{hold_passed}}", noHoldPassed, "{{hold_column}}", "", "{{hold_arg}}", "",
				"{{taken}}", noHoldTaken, "{{release_hold}}", "", "{{list_taken}}", noHoldListTaken)
		}
		acquire := holdParts.Replace(valueParts.Replace(strings.ReplaceAll(acquireSQL, "{{set_waited}}", setWaited)))
		m := &markStatements{
			acquire: fill(strings.NewReplacer("{{mark_cte}}", "", "{{changed}}", "false").Replace(acquire)),
			release: fill(holdParts.Replace(strings.ReplaceAll(releaseSQL, "{{waited}}", waitedCol))),
			list:    fill(holdParts.Replace(valueParts.Replace(listSQL))),
			waited:  waited,
			value:   value,
			hold:    hold,
		}
		m.acquireWait = m.acquire
		if b.notify && waited {
			m.acquireWait = fill(strings.NewReplacer("{{mark_cte}}", markCTE, "{{changed}}", changedSQL).Replace(acquire))
		}
		return m
	}
	b.full, b.marked = forms(true, true, true), forms(true, true, false)
	b.noValue, b.legacy = forms(true, false, false), forms(false, false, false)
	b.stmts.Store(b.full)
	b.acquireBatchSQL = fill(acquireBatchSQL)
	notifyBatch := "0"
	if b.notify {
		notifyBatch = notifyBatchSQL
	}
	b.releaseBatchSQL = fill(strings.ReplaceAll(releaseBatchSQL, "{{notify_batch}}", notifyBatch))
	limit := groupCommitInFlight
	if opts.DisableGroupCommit {
		limit = 0
	}
	b.acquireQ = &gcQueue[sqllock.AcquireRequest, sqllock.Lease]{limit: limit, send: b.sendAcquires}
	b.releaseQ = &gcQueue[sqllock.Lease, struct{}]{limit: limit, send: b.sendReleases}
	b.renewSQL = fill(renewSQL)
	b.renewBatchSQL = fill(renewBatchSQL)
	b.peekSQL = fill(peekSQL)
	b.fenceSQL = fill(fenceSQL)
	b.channelSQL = fill(channelSQL)
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

// nonEmpty is v, or nil when v holds no byte: no value is nil everywhere.
func nonEmpty(v []byte) []byte {
	if len(v) == 0 {
		return nil
	}
	return v
}

// micros is ttl in whole microseconds, rounded up.
func micros(ttl time.Duration) int64 {
	return int64((ttl + time.Microsecond - 1) / time.Microsecond)
}

// leaseMicros is what a statement adds to its "now" for a lease of ttl:
// ttl in whole microseconds, rounded up, and one more. PostgreSQL's clock
// (statement_timestamp(), clock_timestamp()) reads whole microseconds,
// truncated, so the statement's now may be up to 1µs before the instant it
// was read; with the extra microsecond a deadline
// is always later than (that instant + ttl), and so later than the holder's
// send time + ttl, whatever margin the client uses.
func leaseMicros(ttl time.Duration) int64 { return micros(ttl) + 1 }

// holdMicros is what a grant adds to its "now" for a minimum hold: as
// leaseMicros, so that grant + hold is never earlier than asked; 0 for none.
func holdMicros(hold time.Duration) int64 {
	if hold == 0 {
		return 0
	}
	return leaseMicros(hold)
}

// TryAcquire implements [sqllock.Backend.TryAcquire] in one statement (see
// acquireSQL). A refusal reports the holder, its token and remaining time by
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
	if err := req.Validate(); err != nil {
		return sqllock.Lease{}, err
	}
	if err := ctx.Err(); err != nil {
		return sqllock.Lease{}, notSent(opAcquire, req.Key, err)
	}
	watched := b.watched(req.Key)
	if watched || b.acquireQ.limit == 0 {
		return b.tryAcquire(ctx, req, watched)
	}
	return b.acquireQ.do(ctx, req.Key, req, func(ctx context.Context) (sqllock.Lease, error) {
		return b.tryAcquire(ctx, req, false)
	}, notSentErr(opAcquire, req.Key), inFlightErr(opAcquire, req.Key))
}

// tryAcquire sends req alone, in the waiting form when watched.
func (b *Backend) tryAcquire(ctx context.Context, req sqllock.AcquireRequest, watched bool) (sqllock.Lease, error) {
	var r acquireRow
	err := b.withStatements(len(req.Value) > 0, req.MinHold != 0, func(st *markStatements) error {
		q := st.acquire
		if watched {
			q = st.acquireWait
		}
		args := []any{req.Key, leaseMicros(req.TTL), req.Owner}
		if st.value {
			var v []byte // nil: NULL
			if len(req.Value) > 0 {
				v = req.Value
			}
			args = append(args, v)
		}
		if st.hold {
			args = append(args, holdMicros(req.MinHold))
		}
		r.value = nil
		return b.queryRow(ctx, q, args, &r.granted, &r.token, &r.deadline, &r.held, &r.owner, &r.now, &r.changed, &r.value)
	})
	if err != nil {
		return sqllock.Lease{}, b.translate(ctx, opAcquire, req.Key, err)
	}
	return acquired(req, r)
}

// withStatements runs send with the current statements. If the table lacks
// a column they use, the server refused the statement before running it
// (undefined column), so it switches this Backend for good to the forms
// without that column, logs it once, and sends again: without migration
// 00003's "waited" they keep no mark, and every release notifies, as before
// 00003; without 00004's "value" no value is stored or read, and a request
// that needs one (needValue) fails with [sqllock.ErrSchemaMissing] instead,
// before anything is sent; so does, without 00005's "hold_until", a request
// with a minimum hold (needHold), which is never silently ignored. A
// Backend built after the migrations uses them.
func (b *Backend) withStatements(needValue, needHold bool, send func(*markStatements) error) error {
	for {
		st := b.stmts.Load()
		if needValue && !st.value {
			return fmt.Errorf("%w: table %s lacks the \"value\" column of migration 00004 (run `sqllock migrate up`, then rebuild the Backend)",
				sqllock.ErrSchemaMissing, b.table)
		}
		if needHold && !st.hold {
			return fmt.Errorf("%w: table %s lacks the \"hold_until\" column of migration 00005, which a minimum hold needs (run `sqllock migrate up`, then rebuild the Backend)",
				sqllock.ErrSchemaMissing, b.table)
		}
		err := send(st)
		switch {
		case st.waited && missingColumn(err, "waited"):
			if b.stmts.CompareAndSwap(st, b.legacy) {
				b.log.Warn("sqllock/postgres: the lock table lacks the \"waited\" column of migration 00003; "+
					"every release notifies until this Backend is rebuilt after `sqllock migrate up`", "table", b.table)
			}
		case st.hold && missingColumn(err, "hold_until"):
			if b.stmts.CompareAndSwap(st, b.marked) {
				b.log.Warn("sqllock/postgres: the lock table lacks the \"hold_until\" column of migration 00005; "+
					"acquires with a minimum hold fail until this Backend is rebuilt after `sqllock migrate up`", "table", b.table)
			}
		case st.value && missingColumn(err, "value"):
			if b.stmts.CompareAndSwap(st, b.noValue) {
				b.log.Warn("sqllock/postgres: the lock table lacks the \"value\" column of migration 00004; "+
					"acquires with a value fail until this Backend is rebuilt after `sqllock migrate up`", "table", b.table)
			}
		default:
			return err
		}
	}
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
		return sqllock.Lease{}, notSent(opRenew, l.Key, err)
	}
	var (
		renewed, held bool
		current       int64
		deadline, now time.Time
	)
	err := b.queryRowVia(ctx, sendOpts{pooler: true, aside: true}, b.renewSQL, []any{l.Key, l.Token, leaseMicros(ttl)},
		&renewed, &deadline, &current, &held, &now)
	if errors.Is(err, pgx.ErrNoRows) {
		return sqllock.Lease{}, lostReason(l, 0, false, deadline, now) // no row
	}
	if err != nil {
		return sqllock.Lease{}, b.translate(ctx, opRenew, l.Key, err)
	}
	if !renewed {
		return sqllock.Lease{}, lostReason(l, current, held, deadline, now)
	}
	l.Deadline = deadline
	l.BackendTime = now
	return l, nil
}

// TryRenewBatch implements [sqllock.BatchRenewer] in one statement and one
// commit (see renewBatchSQL), whatever the number of leases. A lease whose
// row another transaction holds locked (a fenced transaction, a waiter's
// mark) is not waited for: its result is a transient error, and the client
// renews it on its own. A batch of unknown outcome (context ended or
// connection broke in flight) is [sqllock.ErrUnavailable] for every
// lease: repeating it is safe.
func (b *Backend) TryRenewBatch(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
	if err := sqllock.ValidateRenewBatch(reqs); err != nil {
		return nil, err
	}
	if len(reqs) == 0 {
		return nil, nil
	}
	if err := ctx.Err(); err != nil {
		return nil, notSent(opRenew, reqs[0].Lease.Key, err)
	}
	// Each lease once, with the longest TTL asked for it.
	type id struct {
		key   string
		token int64
	}
	at := make(map[id]int, len(reqs))
	keys := make([]string, 0, len(reqs))
	tokens := make([]int64, 0, len(reqs))
	micros := make([]int64, 0, len(reqs))
	for _, r := range reqs {
		k := id{r.Lease.Key, r.Lease.Token}
		m := leaseMicros(r.TTL)
		if i, ok := at[k]; ok {
			micros[i] = max(micros[i], m)
			continue
		}
		at[k] = len(keys)
		keys, tokens, micros = append(keys, k.key), append(tokens, k.token), append(micros, m)
	}
	type row struct {
		renewed, held bool
		current       int64
		deadline, now time.Time
	}
	rows := make([]row, len(keys))
	var key string
	var token int64
	var r row
	err := b.queryRowsVia(ctx, sendOpts{aside: true}, b.renewBatchSQL, []any{keys, tokens, micros},
		[]any{&key, &token, &r.renewed, &r.deadline, &r.current, &r.held, &r.now}, func() error {
			i, ok := at[id{key, token}]
			if !ok {
				return fmt.Errorf("sqllock/postgres: batch renewal returned an unknown lease %q token %d", key, token)
			}
			rows[i] = r
			return nil
		})
	if err != nil {
		return nil, b.translate(ctx, opRenew, keys[0], err)
	}
	out := make([]sqllock.RenewResult, len(reqs))
	for j, rq := range reqs {
		l := rq.Lease
		r := rows[at[id{l.Key, l.Token}]]
		switch {
		case r.now.IsZero():
			out[j].Err = fmt.Errorf("%w: sqllock/postgres: batch renewal returned no row for %q token %d", sqllock.ErrUnavailable, l.Key, l.Token)
		case r.renewed:
			l.Deadline, l.BackendTime = r.deadline, r.now
			out[j].Lease = l
		case r.current == l.Token && r.held && r.deadline.After(r.now):
			out[j].Err = fmt.Errorf("%w: sqllock/postgres: the row of %q was locked by another transaction; renew it alone", sqllock.ErrUnavailable, l.Key)
		default:
			out[j].Err = lostReason(l, r.current, r.held, r.deadline, r.now)
		}
	}
	return out, nil
}

// lostReason explains why lease l could not be renewed or fenced, from the
// key's row as the statement's snapshot saw it (current token 0: no row).
func lostReason(l sqllock.Lease, current int64, held bool, deadline, now time.Time) *sqllock.LostError {
	st := sqllock.KeyState{Found: current > 0, Token: current, Held: held, Expired: !deadline.After(now)}
	if lost := st.Loss(l); lost != nil {
		return lost
	}
	// Valid in the snapshot, yet the UPDATE refused the newer row: it was
	// released (or, rarely, expired and taken) while the statement ran.
	return &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostReleased}
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
// of the key flushes the release before it commits. See releaseSQL.
func (b *Backend) Release(ctx context.Context, l sqllock.Lease) error {
	if err := sqllock.ValidateLease(l); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return notSent(opRelease, l.Key, err)
	}
	if b.releaseQ.limit == 0 {
		return b.releaseAlone(ctx, l)
	}
	_, err := b.releaseQ.do(ctx, l.Key, l, func(ctx context.Context) (struct{}, error) {
		return struct{}{}, b.releaseAlone(ctx, l)
	}, notSentErr(opRelease, l.Key), inFlightErr(opRelease, l.Key))
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
		opRelease, l.Key, sqllock.ErrUnavailable)
}

// errRaced: a release found l's lease held again by its owner in a fresh
// read after its UPDATE lost a race; it has to be sent again.
var errRaced = errors.New("release raced a re-grant")

func (b *Backend) release(ctx context.Context, l sqllock.Lease) error {
	var (
		released, valid, held bool
		current, notified     int64
		deadline, now         time.Time
		owner                 string
	)
	err := b.withStatements(false, false, func(st *markStatements) error {
		return b.queryRowVia(ctx, sendOpts{pooler: true, aside: true}, st.release, []any{l.Key, l.Token, l.Owner},
			&released, &valid, &current, &held, &deadline, &owner, &now, &notified)
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return releasedLost(l, false, 0, false, "") // the key has no row
	}
	if err != nil {
		return b.translate(ctx, opRelease, l.Key, err)
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

// releasedLost is Release's answer when its statement cleared nothing and
// the row (found, token, held, owner) is not l's lease held: nil for a
// lease l's owner released before, errRaced when l's token is held again
// (re-granted to l's owner by a retried acquire since the release's
// snapshot), else why l is lost.
func releasedLost(l sqllock.Lease, found bool, token int64, held bool, owner string) error {
	st := sqllock.KeyState{Found: found, Token: token, Held: held, Owner: owner}
	if st.ReleasedByOwner(l) {
		return nil // released before, by l's owner
	}
	if lost := st.Loss(l); lost != nil {
		return lost
	}
	return errRaced // held with l's token (Loss is nil only then)
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
	err := b.queryRow(ctx, b.peekSQL, []any{l.Key}, &token, &held, &deadline, &owner, &now)
	if errors.Is(err, pgx.ErrNoRows) {
		return releasedLost(l, false, 0, false, "")
	}
	if err != nil {
		return b.translate(ctx, opRelease, l.Key, err)
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
		return nil, notSent(opList, prefix, err)
	}
	var out []sqllock.LockInfo
	list := func() error {
		return b.withStatements(false, false, func(st *markStatements) error {
			out = out[:0]
			rows, err := b.pool.Query(ctx, st.list, prefix)
			if err != nil {
				return err
			}
			var i sqllock.LockInfo
			var now time.Time
			_, err = pgx.ForEachRow(rows, []any{&i.Key, &i.Token, &i.Owner, &i.Held, &i.Deadline, &now, &i.Value}, func() error {
				i.Remaining = 0
				if i.Held {
					i.Remaining = i.Deadline.Sub(now)
				}
				i.Value = nonEmpty(i.Value)
				out = append(out, i)
				i.Value = nil // scanned fresh for the next row
				return nil
			})
			return err
		})
	}
	// A read-only statement too can fail with a serialization failure.
	if err := b.retryConflicts(ctx, list); err != nil {
		return nil, b.translate(ctx, opList, prefix, err)
	}
	return out, nil
}
