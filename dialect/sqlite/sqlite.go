// Package sqlite is ashlock's SQLite backend: leases and fencing tokens in a
// table of a SQLite database file, safe across the processes of one host
// (SQLite's file locks are the arbiter), on modernc.org/sqlite (pure Go, no
// cgo).
//
// [Open] opens a file that the backend owns: it builds the DSN (see [DSN]),
// applies the library's migrations, and closes the database in [Backend.Close].
// [New] wraps an application's own *sql.DB, which it never closes; the
// application then applies the migrations (package migrations, or `sqllock
// migrate up`) and should build its DSN with [DSN] so that every pooled
// connection has the pragmas below.
//
// # Time
//
// SQLite computes every deadline itself, as integer Unix milliseconds from
// the wall clock of the host (all processes on one host share it). TTLs are
// rounded up to whole milliseconds, and one more is added because the clock
// reads whole milliseconds, truncated (see leaseMillis).
//
// The wall clock can step. A step back by d under a holder ends its lease d
// later: a takeover after a crash waits d longer, nothing else changes. A
// step forward by more than the holder's margin ends the lease at the
// database before the holder's local deadline: another process can be
// granted the key while the holder still works, and only the fencing token
// keeps its stale writes out. Keep the clock slewed (NTP), not stepped.
//
// # Statements
//
// TryAcquire and TryRenew are one statement each, also when they fail: a
// refused attempt returns the current row (holder, token, remaining time or
// the reason of the loss) from the same statement and writes nothing.
// Release is one statement unless the lease was already released or
// superseded; then a read follows to tell which. See queries.go.
//
// # Busy database
//
// SQLite's busy handler is not fair: a process sleeping in it can lose the
// write lock to the same other process again and again. So each connection
// has a short busy_timeout ([Options.BusyTimeout], 10 ms by default) and the
// backend retries SQLITE_BUSY and SQLITE_LOCKED itself, with jittered
// exponential sleeps, for up to [Options.RetryTimeout] or until the caller's
// context ends, whichever is first; then it returns an error matching
// [sqllock.ErrUnavailable]. A raw SQLITE_BUSY never reaches the caller. The
// backend sends at most one write at a time per process (a semaphore), so
// its own goroutines queue in Go, first come first served, instead of
// fighting in SQLite's busy handler.
//
// # Outcomes are never indeterminate, except after an I/O error
//
// A statement in flight is never interrupted: the caller's context bounds
// each attempt's wait for a connection (an application's pool may be busy)
// and the sleeps between attempts, but not the statement itself once it has
// its connection (it lasts at most the busy timeout plus one commit). The backend reads the statement to its
// end, so its autocommit transaction has committed when the reply is read.
// Hence an error means the statement did not apply (SQLite rolled it back),
// and a cancelled context yields "not applied" rather than
// [sqllock.ErrIndeterminate]. The exception is an I/O error (SQLITE_IOERR,
// for example a failed fsync at commit): the commit record may have reached
// the WAL file and be recovered later, so a write that ends in an I/O error
// is reported as [sqllock.ErrIndeterminate].
//
// # Watcher
//
// SQLite cannot notify other processes, so waiters in other processes poll.
// [Backend.Watch] wakes waiters of this process when a release made through
// the same Backend clears a lease: cheap, and the common case of several
// goroutines of one program waiting for each other.
package sqlite

import (
	"cmp"
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	_ "modernc.org/sqlite" // registers the "sqlite" database/sql driver

	"github.com/ashlock/ashlock/internal/sqlident"
	"github.com/ashlock/ashlock/internal/wait"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// Synchronous is SQLite's synchronous pragma for the database file, which
// decides how durable a grant is.
type Synchronous string

const (
	// SynchronousFull fsyncs the write-ahead log at every commit: a grant
	// that was reported survives a power cut. It costs one fsync per
	// acquire, renew and release (~1-2k acquire+release pairs/s measured).
	SynchronousFull Synchronous = "FULL"

	// SynchronousNormal fsyncs only at checkpoints. In WAL mode this is
	// safe against a crash of the process but not of the machine: a power
	// cut can lose the last commits, so a grant can be lost after it was
	// reported, and the same token can then be handed out twice; a fenced
	// resource would see two holders with one token. It is about 4× faster
	// than FULL (bench/results/latest.md: 4,991 against 1,360 pairs/s on one
	// goroutine; BenchmarkPairs). Choose it only when the lock table dies
	// with the machine anyway (a tmpfs), or when duplicate tokens after a
	// power cut are acceptable.
	SynchronousNormal Synchronous = "NORMAL"
)

// openTimeout bounds the setup I/O of [Open] and [New] (migrations, the
// in-memory check), busy retries included, whatever Options.RetryTimeout.
const openTimeout = 30 * time.Second

// Defaults for the zero [Options].
const (
	DefaultBusyTimeout  = 10 * time.Millisecond
	DefaultRetryTimeout = 2 * time.Second
)

// Options configure a [Backend]. The zero value means the defaults.
type Options struct {
	// Table is the lock table's name, a plain identifier (letters, digits,
	// underscore) of at most 55 bytes, so that the migrations can name its
	// version table "<Table>_version"; empty means migrations.DefaultTable
	// ("sqllock_locks").
	Table string

	// Synchronous is the synchronous pragma for [Open] and [DSN]; empty
	// means [SynchronousFull]. See [SynchronousNormal] for the trade-off.
	// [New] refuses it: set it in your own DSN.
	Synchronous Synchronous

	// BusyTimeout is SQLite's busy_timeout for [Open] and [DSN]: how long
	// one statement waits in SQLite's (unfair) busy handler before the
	// backend's own retry takes over. Zero means [DefaultBusyTimeout];
	// keep it short. [New] refuses it: set it in your own DSN.
	BusyTimeout time.Duration

	// ReadOnly makes [Open] open the file for reading only (SQLite's
	// mode=ro, SQLITE_OPEN_READONLY), for inspection: List and what reads
	// the lock table work on a file this process cannot write, and nothing
	// is migrated (a file without the lock table reports
	// [sqllock.ErrSchemaMissing]); every write fails with an error matching
	// [ErrUnusable]. Without it, Open fails at once, with [ErrUnusable], on
	// a file it cannot write. [DSN] and [New] refuse it: add mode=ro to
	// your own DSN.
	ReadOnly bool

	// RetryTimeout bounds how long one operation retries a busy database
	// (SQLITE_BUSY, SQLITE_LOCKED) before it returns an error matching
	// [sqllock.ErrUnavailable]; the caller's context can end it earlier.
	// Zero means [DefaultRetryTimeout]; negative means no retry.
	RetryTimeout time.Duration
}

// ErrInMemory is returned by [Open], [DSN] and [New] for an in-memory
// database (":memory:", "file::memory:", mode=memory, an empty path). Each
// pooled connection to ":memory:" sees its own empty database, and any
// in-memory database loses its token history when its last connection
// closes, after which tokens restart at 1 and fencing breaks. Use a file, or
// package memory for a lock within one process.
var ErrInMemory = errors.New("sqllock/sqlite: in-memory database refused (use a file, or package memory)")

// Backend is the SQLite [sqllock.Backend]. It is safe for concurrent use.
type Backend struct {
	db    *sql.DB
	owned bool
	table string // unquoted, for messages

	// The statements, with the table and clock filled in.
	acquireSQL, renewSQL, releaseSQL, peekSQL, listSQL, listFromSQL string
	renewBatchSQL, nowSQL                                           string

	retryTimeout time.Duration
	writeSlot    chan struct{} // one write statement at a time per Backend

	stmtMu sync.Mutex
	stmts  map[string]*sql.Stmt // prepared lazily (the table may not exist yet)

	closed      atomic.Bool
	busyRetries atomic.Uint64

	signals wait.Signals
}

var (
	_ sqllock.BatchRenewer = (*Backend)(nil)
	_ sqllock.Backend      = (*Backend)(nil)
	_ sqllock.Watcher      = (*Backend)(nil)
)

// resolve returns o with the defaults filled in, validated.
func (o Options) resolve() (Options, error) {
	o.Table = cmp.Or(o.Table, migrations.DefaultTable)
	if err := sqlident.ValidateTable(o.Table); err != nil {
		return o, fmt.Errorf("sqllock/sqlite: Options.Table: %w", err)
	}
	switch strings.ToUpper(string(o.Synchronous)) {
	case "":
		o.Synchronous = SynchronousFull
	case string(SynchronousFull), string(SynchronousNormal):
		o.Synchronous = Synchronous(strings.ToUpper(string(o.Synchronous)))
	default:
		return o, fmt.Errorf("sqllock/sqlite: Options.Synchronous %q: want %q or %q", o.Synchronous, SynchronousFull, SynchronousNormal)
	}
	switch {
	case o.BusyTimeout == 0:
		o.BusyTimeout = DefaultBusyTimeout
	case o.BusyTimeout < time.Millisecond || o.BusyTimeout > time.Minute:
		return o, fmt.Errorf("sqllock/sqlite: Options.BusyTimeout %v: want 1ms to 1m", o.BusyTimeout)
	}
	switch {
	case o.RetryTimeout == 0:
		o.RetryTimeout = DefaultRetryTimeout
	case o.RetryTimeout < 0:
		o.RetryTimeout = 0
	}
	return o, nil
}

// DSN returns the modernc.org/sqlite data source name [Open] uses for the
// database file at path, for applications that open the *sql.DB themselves
// and pass it to [New]. The pragmas are DSN parameters, so that every
// connection of the pool gets them (a db.Exec("PRAGMA ...") reaches one
// connection only):
//
//	_pragma=busy_timeout(N)    Options.BusyTimeout, in ms
//	_pragma=journal_mode(WAL)  readers never block the writer
//	_pragma=synchronous(X)     Options.Synchronous
//	_pragma=foreign_keys(1)    harmless here, expected by applications
//	_txlock=immediate          BEGIN takes the write lock at once, so a
//	                           read-then-write transaction cannot fail with
//	                           SQLITE_BUSY_SNAPSHOT (the backend itself uses
//	                           single statements)
//
// path is a file name, not a URI: a "file:" URI, an empty path and
// ":memory:" are refused (the latter two with [ErrInMemory]), and so is a
// '?' in the path, which the driver would take for the start of the query.
func DSN(path string, opts Options) (string, error) {
	if opts.ReadOnly {
		return "", errors.New("sqllock/sqlite: DSN: Options.ReadOnly is for Open; add mode=ro to a file: URI yourself")
	}
	o, err := opts.resolve()
	if err != nil {
		return "", err
	}
	return dsn(path, o)
}

func dsn(path string, o Options) (string, error) {
	switch {
	case path == "", path == ":memory:",
		strings.HasPrefix(path, "file:") && (strings.Contains(path, ":memory:") || strings.Contains(path, "mode=memory")):
		return "", fmt.Errorf("%w: %q", ErrInMemory, path)
	case strings.HasPrefix(path, "file:"):
		return "", fmt.Errorf("sqllock/sqlite: %q: want a file path, not a URI (or open it yourself and use New)", path)
	case strings.ContainsAny(path, "?\x00"):
		return "", fmt.Errorf("sqllock/sqlite: %q: a path with '?' or NUL is not supported", path)
	}
	ms := (o.BusyTimeout + time.Millisecond - 1) / time.Millisecond
	q := url.Values{}
	q.Add("_pragma", "busy_timeout("+strconv.FormatInt(int64(ms), 10)+")")
	q.Add("_pragma", "journal_mode(WAL)")
	q.Add("_pragma", "synchronous("+string(o.Synchronous)+")")
	q.Add("_pragma", "foreign_keys(1)")
	q.Set("_txlock", "immediate")
	return path + "?" + q.Encode(), nil
}

// Open opens (creating it if needed) the SQLite database file at path,
// applies the library's migrations, and returns a Backend that owns the
// database: [Backend.Close] closes it. The pool has a single connection, so
// the process holds one SQLite connection to the file. See [DSN] for the
// pragmas and the paths refused.
func Open(path string, opts Options) (*Backend, error) {
	o, err := opts.resolve()
	if err != nil {
		return nil, err
	}
	name, err := dsn(path, o)
	if err != nil {
		return nil, err
	}
	if o.ReadOnly {
		name = readOnlyDSN(path, o)
	}
	db, err := sql.Open("sqlite", name)
	if err != nil {
		return nil, fmt.Errorf("sqllock/sqlite: open %q: %w", path, err)
	}
	db.SetMaxOpenConns(1)
	db.SetMaxIdleConns(1)
	db.SetConnMaxLifetime(0)
	db.SetConnMaxIdleTime(0)
	b := newBackend(db, o, true)

	// Several processes may open a new file at once: the migration is
	// retried while the database is busy (and migrations.Up reports
	// success to the loser of a race once everything is applied).
	ctx, cancel := context.WithTimeout(context.Background(), openTimeout)
	defer cancel()
	if o.ReadOnly {
		// Reads the schema once, so that a file that is not a database
		// (or cannot be opened) fails here, as it does without ReadOnly.
		err = b.retry(ctx, openTimeout, func(ctx context.Context) error {
			var n int
			return db.QueryRowContext(ctx, `SELECT count(*) FROM sqlite_schema`).Scan(&n)
		})
		if err != nil {
			db.Close()
			return nil, fmt.Errorf("sqllock/sqlite: open %q read-only: %w", path, b.translate(err, false))
		}
		return b, nil
	}
	err = b.retry(ctx, openTimeout, func(ctx context.Context) error {
		return migrations.Up(ctx, migrations.SQLite, db, migrations.Options{Table: o.Table})
	})
	if err != nil {
		db.Close()
		return nil, fmt.Errorf("sqllock/sqlite: migrate %q: %w", path, b.translate(err, false))
	}
	// A file migrated already is only read by the migrations: check that
	// it can be written, so that a read-only file fails here and not at
	// the first acquire. Taking the write lock is not enough (in WAL mode
	// it lives in the -shm file, which may be writable): the check writes
	// the header's user_version, unchanged, in a transaction it rolls
	// back. A busy database is one another connection writes: writable.
	err = func() error { // once: busy is an answer here, not a wait
		tx, err := db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback() }()
		var v int64
		if err := tx.QueryRowContext(ctx, `PRAGMA user_version`).Scan(&v); err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx, `PRAGMA user_version = `+strconv.FormatInt(v, 10))
		return err
	}()
	if err != nil && !isBusy(err) && errors.Is(b.translate(err, true), ErrUnusable) {
		db.Close()
		return nil, fmt.Errorf("sqllock/sqlite: open %q for writing: %w", path, b.translate(err, true))
	}
	return b, nil
}

// readOnlyDSN is the DSN of a read-only Open: a file: URI with mode=ro
// (the driver passes those to SQLite whole), the busy timeout, and no
// journal_mode pragma, which would write.
func readOnlyDSN(path string, o Options) string {
	ms := (o.BusyTimeout + time.Millisecond - 1) / time.Millisecond
	escaped := strings.NewReplacer("%", "%25", "?", "%3f", "#", "%23").Replace(path)
	q := url.Values{}
	q.Set("mode", "ro")
	q.Add("_pragma", "busy_timeout("+strconv.FormatInt(int64(ms), 10)+")")
	return "file:" + escaped + "?" + q.Encode()
}

// New returns a Backend on an application's database handle, which it never
// closes. It applies no migrations: create the table first (package
// migrations or `sqllock migrate up`); until then operations fail with
// [sqllock.ErrSchemaMissing]. Options.Synchronous and Options.BusyTimeout
// are connection settings and are refused here: build the handle's DSN with
// [DSN]. An in-memory database is refused with [ErrInMemory]; New reads
// PRAGMA database_list to tell.
//
// The Backend sends one write at a time, whatever the pool size; for the
// fairness described in the package doc, prefer a small pool and short
// busy_timeout. Do not call the Backend while the same goroutine holds a
// write transaction on the database: the Backend's statement would wait for
// that transaction (for a connection, or for the write lock until
// Options.RetryTimeout) and fail.
func New(db *sql.DB, opts Options) (*Backend, error) {
	if db == nil {
		return nil, errors.New("sqllock/sqlite: New: nil *sql.DB")
	}
	if opts.Synchronous != "" || opts.BusyTimeout != 0 || opts.ReadOnly {
		return nil, errors.New("sqllock/sqlite: New: Options.Synchronous, Options.BusyTimeout and Options.ReadOnly are DSN settings; build your DSN with sqlite.DSN (and mode=ro)")
	}
	o, err := opts.resolve()
	if err != nil {
		return nil, err
	}
	b := newBackend(db, o, false)
	ctx, cancel := context.WithTimeout(context.Background(), openTimeout)
	defer cancel()
	var file string
	err = b.retry(ctx, openTimeout, func(ctx context.Context) error {
		return db.QueryRowContext(ctx, `SELECT file FROM pragma_database_list WHERE name = 'main'`).Scan(&file)
	})
	if err != nil {
		return nil, fmt.Errorf("sqllock/sqlite: New: %w", b.translate(err, false))
	}
	if file == "" {
		return nil, fmt.Errorf("%w: the handle's main database has no file", ErrInMemory)
	}
	return b, nil
}

func newBackend(db *sql.DB, o Options, owned bool) *Backend {
	b := &Backend{
		db:           db,
		owned:        owned,
		table:        o.Table,
		retryTimeout: o.RetryTimeout,
		writeSlot:    make(chan struct{}, 1),
		stmts:        make(map[string]*sql.Stmt),
	}
	b.renderQueries(nowMS)
	return b
}

// renderQueries fills in the statements with the table and now, the SQL
// expression of the clock ([nowMS]; tests step it).
func (b *Backend) renderQueries(now string) {
	t := sqlident.QuoteSQLite(b.table)
	b.acquireSQL = render(acquireSQL, t, now)
	b.renewSQL = render(renewSQL, t, now)
	b.renewBatchSQL = render(renewBatchSQL, t, now)
	b.nowSQL = render(nowSQL, t, now)
	b.releaseSQL = render(releaseSQL, t, now)
	b.peekSQL = render(peekSQL, t, now)
	b.listSQL = render(listSQL, t, now)
	b.listFromSQL = render(listFromSQL, t, now)
}

// Close releases the prepared statements and, for a Backend from [Open],
// closes the database. Later calls fail with [sqllock.ErrClosed]. Close
// does not release leases; they expire.
func (b *Backend) Close() error {
	if b.closed.Swap(true) {
		return nil
	}
	b.stmtMu.Lock()
	var errs []error
	for _, s := range b.stmts {
		errs = append(errs, s.Close())
	}
	clear(b.stmts)
	b.stmtMu.Unlock()
	if b.owned {
		errs = append(errs, b.db.Close())
	}
	return errors.Join(errs...)
}

// Stats are counters for tests and monitoring.
type Stats struct {
	// BusyRetries counts statements that found the database busy
	// (SQLITE_BUSY or SQLITE_LOCKED after the busy timeout) and were
	// retried or given up on.
	BusyRetries uint64
}

// Stats returns the backend's counters.
func (b *Backend) Stats() Stats { return Stats{BusyRetries: b.busyRetries.Load()} }

// ttlMillis rounds ttl up to whole milliseconds.
func ttlMillis(ttl time.Duration) int64 {
	return int64((ttl + time.Millisecond - 1) / time.Millisecond)
}

// leaseMillis is what a statement adds to its now for a lease of ttl: ttl
// in whole milliseconds, rounded up, and one more. SQLite's clock reads
// whole milliseconds, truncated, so a statement's now may be up to 1 ms
// before the instant it was read; with the extra millisecond a deadline is
// always later than (that instant + ttl), and so later than the holder's
// send time + ttl, whatever margin the client uses. (Without it a second
// client was granted the key before the first's local deadline in 7 of
// 300 rounds at TTL 20 ms and a 200µs margin.)
func leaseMillis(ttl time.Duration) int64 { return ttlMillis(ttl) + 1 }

// remaining is how long a lease with deadline has left at least, by a
// clock that read now: the instant now stands for may be up to 1 ms later
// (see leaseMillis), so one millisecond less, and never below zero. It is
// never more than the lease's TTL.
func remaining(deadline, now int64) time.Duration {
	return time.Duration(max(deadline-now-1, 0)) * time.Millisecond
}

// TryAcquire implements [sqllock.Backend] with one statement (acquireSQL).
func (b *Backend) TryAcquire(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	if err := req.Validate(); err != nil {
		return sqllock.Lease{}, err
	}
	var (
		token, deadline, now int64
		held, kept           bool
		owner                string
		value                []byte
	)
	var arg any // NULL for no value
	if len(req.Value) > 0 {
		arg = req.Value
	}
	err := b.write(ctx, func(ctx context.Context) error {
		_, err := b.queryRow(ctx, b.acquireSQL, []any{req.Key, leaseMillis(req.TTL), req.Owner, arg, minHoldMillis(req.MinHold)},
			&token, &held, &deadline, &owner, &value, &now, &kept)
		return err
	})
	if err != nil {
		return sqllock.Lease{}, b.translate(err, true)
	}
	switch {
	case held && deadline > now && owner == req.Owner:
		return sqllock.Lease{
			Key:         req.Key,
			Token:       token,
			Owner:       owner,
			Deadline:    time.UnixMilli(deadline),
			BackendTime: time.UnixMilli(now),
			Value:       nonEmpty(value),
		}, nil
	case (held || kept) && deadline > now: // kept: released inside its min hold
		return sqllock.Lease{}, &sqllock.HeldError{
			Key: req.Key, Owner: owner, Token: token,
			Remaining: remaining(deadline, now),
			Value:     nonEmpty(value),
		}
	case token == math.MaxInt64:
		return sqllock.Lease{}, fmt.Errorf("%w: key %q", sqllock.ErrTokenExhausted, req.Key)
	default:
		return sqllock.Lease{}, fmt.Errorf("sqllock/sqlite: TryAcquire %q: unexpected row (token %d, held %v, deadline %d, now %d)",
			req.Key, token, held, deadline, now)
	}
}

// minHoldMillis is a min hold in milliseconds, rounded up (0 for none).
func minHoldMillis(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return leaseMillis(d)
}

// nonEmpty is v, or nil when v holds no byte: no value is nil everywhere.
func nonEmpty(v []byte) []byte {
	if len(v) == 0 {
		return nil
	}
	return v
}

// TryRenew implements [sqllock.Backend] with one statement (renewSQL).
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
	err := b.write(ctx, func(ctx context.Context) (err error) {
		found, err = b.queryRow(ctx, b.renewSQL, []any{l.Key, l.Token, leaseMillis(ttl)},
			&token, &held, &deadline, &now)
		return err
	})
	if err != nil {
		return sqllock.Lease{}, b.translate(err, true)
	}
	if found && token == l.Token && held && deadline > now {
		l.Deadline = time.UnixMilli(deadline)
		l.BackendTime = time.UnixMilli(now)
		return l, nil
	}
	if lost := keyState(found, token, held, deadline, now, "").Loss(l); lost != nil {
		return sqllock.Lease{}, lost
	}
	return sqllock.Lease{}, fmt.Errorf("sqllock/sqlite: TryRenew %q: unexpected row (token %d, held %v, deadline %d, now %d)",
		l.Key, token, held, deadline, now)
}

// TryRenewBatch implements [sqllock.BatchRenewer]: one statement
// (renewBatchSQL) in one write transaction (BEGIN IMMEDIATE, with the read
// of the clock before it), at one instant of the database clock, and so one
// commit, one fsync with synchronous=FULL, for the whole batch. Each key is
// renewed once: with its largest token among the batch's leases (a smaller
// one is an older tenure, which cannot be current while the larger exists)
// and the longest TTL asked for that lease. A batch of unknown outcome is
// [sqllock.ErrUnavailable] for every lease: repeating it is safe.
func (b *Backend) TryRenewBatch(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
	if err := sqllock.ValidateRenewBatch(reqs); err != nil {
		return nil, err
	}
	if len(reqs) == 0 {
		return nil, nil
	}
	type ask struct {
		token, ms int64
	}
	asks := make(map[string]ask, len(reqs))
	for _, r := range reqs {
		a, ok := asks[r.Lease.Key]
		ms := leaseMillis(r.TTL)
		switch {
		case !ok || r.Lease.Token > a.token:
			asks[r.Lease.Key] = ask{r.Lease.Token, ms}
		case r.Lease.Token == a.token:
			asks[r.Lease.Key] = ask{a.token, max(a.ms, ms)}
		}
	}
	elems := make([][3]any, 0, len(asks))
	for key, a := range asks {
		elems = append(elems, [3]any{key, a.token, a.ms})
	}
	arg, err := json.Marshal(elems)
	if err != nil {
		return nil, err
	}
	type row struct {
		held            bool
		token, deadline int64
	}
	rows := make(map[string]row, len(asks))
	var now int64
	err = b.write(ctx, func(ctx context.Context) error {
		return b.inWriteTx(ctx, func(conn *sql.Conn) error {
			clear(rows)
			if err := conn.QueryRowContext(ctx, b.nowSQL).Scan(&now); err != nil {
				return err
			}
			rs, err := conn.QueryContext(ctx, b.renewBatchSQL, string(arg), now)
			if err != nil {
				return err
			}
			defer rs.Close()
			for rs.Next() {
				var key string
				var r row
				if err := rs.Scan(&key, &r.token, &r.held, &r.deadline); err != nil {
					return err
				}
				rows[key] = r
			}
			return rs.Err()
		})
	})
	if err != nil {
		err = b.translate(err, true)
		if errors.Is(err, sqllock.ErrIndeterminate) || !errors.Is(err, sqllock.ErrUnavailable) && !errors.Is(err, sqllock.ErrSchemaMissing) {
			err = fmt.Errorf("%w: sqllock/sqlite: batch renewal: %w", sqllock.ErrUnavailable, err)
		}
		return nil, err
	}
	out := make([]sqllock.RenewResult, len(reqs))
	for j, rq := range reqs {
		l := rq.Lease
		r, found := rows[l.Key]
		if found && r.token == l.Token && r.held && r.deadline > now {
			l.Deadline, l.BackendTime = time.UnixMilli(r.deadline), time.UnixMilli(now)
			out[j].Lease = l
			continue
		}
		if lost := keyState(found, r.token, r.held, r.deadline, now, "").Loss(l); lost != nil {
			out[j].Err = lost
			continue
		}
		out[j].Err = fmt.Errorf("%w: sqllock/sqlite: batch renewal of %q: unexpected row (token %d, held %v, deadline %d, now %d)",
			sqllock.ErrUnavailable, l.Key, r.token, r.held, r.deadline, now)
	}
	return out, nil
}

// inWriteTx runs fn in a write transaction on a connection of its own,
// begun IMMEDIATE (the write lock at once, whatever the DSN's _txlock), and
// commits it, or rolls it back if fn fails.
func (b *Backend) inWriteTx(ctx context.Context, fn func(conn *sql.Conn) error) error {
	conn, err := b.db.Conn(ctx)
	if err != nil {
		return &notSentError{cause: err}
	}
	defer conn.Close()
	if _, err := conn.ExecContext(ctx, "BEGIN IMMEDIATE"); err != nil {
		return err
	}
	if err := fn(conn); err != nil {
		_, _ = conn.ExecContext(context.WithoutCancel(ctx), "ROLLBACK")
		return err
	}
	if _, err := conn.ExecContext(ctx, "COMMIT"); err != nil {
		_, _ = conn.ExecContext(context.WithoutCancel(ctx), "ROLLBACK")
		return err
	}
	return nil
}

// keyState is the key's row (found, token, held, deadline, owner) at now.
func keyState(found bool, token int64, held bool, deadline, now int64, owner string) sqllock.KeyState {
	return sqllock.KeyState{Found: found, Token: token, Held: held, Expired: deadline <= now, Owner: owner}
}

// Release implements [sqllock.Backend]: one statement (releaseSQL) when the
// lease was held, clean or expired; when it cleared nothing, one read more
// (peekSQL) tells "released twice" by its owner (nil) from a release by
// someone else, a newer token or an unknown one (a [*sqllock.LostError]).
func (b *Backend) Release(ctx context.Context, l sqllock.Lease) error {
	if err := sqllock.ValidateLease(l); err != nil {
		return err
	}
	var result error
	cleared := false
	err := b.write(ctx, func(ctx context.Context) error {
		var deadline, now int64
		found, err := b.queryRow(ctx, b.releaseSQL, []any{l.Key, l.Token, l.Owner}, &deadline, &now)
		if err != nil {
			return err
		}
		if found {
			cleared = true
			if deadline <= now {
				result = &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostExpired}
			}
			return nil
		}
		// Nothing cleared. The row can only have moved forward since
		// (tokens only grow), so this read describes a state at least as
		// new as the one the UPDATE saw.
		var (
			token int64
			held  bool
			owner string
		)
		found, err = b.queryRow(ctx, b.peekSQL, []any{l.Key}, &token, &held, &deadline, &owner, &now)
		if err != nil {
			return err
		}
		st := keyState(found, token, held, deadline, now, owner)
		if st.ReleasedByOwner(l) {
			return nil // released twice by its owner
		}
		if lost := st.Loss(l); lost != nil {
			result = lost
			return nil
		}
		// Held with l's token, so it was re-granted to its owner (a
		// retried acquire) between the two statements: try again.
		return errRetry
	})
	if cleared {
		b.signals.Signal(l.Key)
	}
	if err != nil {
		return b.translate(err, true)
	}
	return result
}

// List implements [sqllock.Backend] with one read (an index range on the
// key, no LIKE).
func (b *Backend) List(ctx context.Context, prefix string) ([]sqllock.LockInfo, error) {
	if err := sqllock.ValidatePrefix(prefix); err != nil {
		return nil, err
	}
	query, args := b.listFromSQL, []any{prefix}
	if end, ok := prefixEnd(prefix); ok {
		query, args = b.listSQL, []any{prefix, end}
	}
	var out []sqllock.LockInfo
	err := b.read(ctx, func(ctx context.Context) error {
		out = out[:0]
		stmt, err := b.stmt(ctx, query)
		if err != nil {
			return err
		}
		sctx, args, g, release := shield(ctx, args)
		defer release()
		rows, err := stmt.QueryContext(sctx, args...)
		if err != nil {
			return g.notSent(err)
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
			i.Deadline = time.UnixMilli(deadline)
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
		return nil, b.translate(err, false)
	}
	return out, nil
}

// Watch implements [sqllock.Watcher] for releases made through this Backend
// (other processes are not seen; their waiters poll).
func (b *Backend) Watch(key string) (<-chan struct{}, func()) { return b.signals.Watch(key) }
