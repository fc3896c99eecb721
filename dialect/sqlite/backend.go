package sqlite

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"math"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	_ "modernc.org/sqlite" // registers the "sqlite" database/sql driver

	"github.com/ashlock/ashlock/internal/keyrange"
	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/internal/wait"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// Backend is the SQLite [sqllock.Backend]. It is safe for concurrent use.
type Backend struct {
	db    *sql.DB
	owned bool
	table string // unquoted, for messages

	// The statements, rendered once by renderQueries (queries.go).
	acquireSQL, renewSQL, releaseSQL, peekSQL, listSQL, listFromSQL string
	renewBatchSQL, nowSQL                                           string
	permit                                                          permitQueries
	acquireAllSQL, releaseAllSQL                                    string // multi.go
	reapSQL, reapBeginSQL, reapEndSQL                               string // reap.go
	acquireMarkSQL                                                  string // a waiting writer's acquire
	shared                                                          sharedQueries

	retryTimeout time.Duration
	writeSlot    writeSlot // one write statement at a time per Backend, renewals first

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
	if err := checkDriver(db.Driver()); err != nil {
		return nil, err
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
	if err != nil && strings.Contains(err.Error(), `"pragma_database_list" does not exist`) {
		// A PostgreSQL driver checkDriver does not know (a wrapper).
		return nil, fmt.Errorf("sqllock/sqlite: New: the *sql.DB is not SQLite's (PostgreSQL's? open the Backend with postgres.NewDB): %w", err)
	}
	if err != nil {
		return nil, fmt.Errorf("sqllock/sqlite: New: %w", b.translate(err, false))
	}
	if file == "" {
		return nil, fmt.Errorf("%w: the handle's main database has no file", ErrInMemory)
	}
	return b, nil
}

// checkDriver refuses, before any I/O, a *sql.DB whose driver is one of
// PostgreSQL's (pgx's stdlib, lib/pq), known by its package.
func checkDriver(d driver.Driver) error {
	t := reflect.TypeOf(d)
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == nil {
		return nil
	}
	switch pkg := t.PkgPath(); {
	case strings.HasPrefix(pkg, "github.com/jackc/pgx/"), pkg == "github.com/lib/pq":
		return fmt.Errorf("sqllock/sqlite: New: the *sql.DB's driver is PostgreSQL's (%s): open the Backend with postgres.NewDB "+
			"(package github.com/ashlock/ashlock/dialect/postgres)", pkg)
	}
	return nil
}

func newBackend(db *sql.DB, o Options, owned bool) *Backend {
	b := &Backend{
		db:           db,
		owned:        owned,
		table:        o.Table,
		retryTimeout: o.RetryTimeout,
		stmts:        make(map[string]*sql.Stmt),
	}
	b.renderQueries(nowMS)
	return b
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

// TryAcquire implements [sqllock.Backend] with one statement (acquireSQL).
func (b *Backend) TryAcquire(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	if req.Shared {
		return b.tryAcquireShared(ctx, req)
	}
	if err := req.Validate(); err != nil {
		return sqllock.Lease{}, err
	}
	var (
		token, deadline, now int64
		held, kept           bool
		owner, waiting       string
		value                []byte
		shared               int
	)
	query := b.acquireSQL
	if req.Mark {
		query = b.acquireMarkSQL
	}
	var arg any // NULL for no value
	if len(req.Value) > 0 {
		arg = req.Value
	}
	err := b.write(ctx, outcome.Acquire, req.Key, func(ctx context.Context) error {
		_, err := b.queryRow(ctx, outcome.Acquire, query, []any{req.Key, leaseMillis(req.TTL), req.Owner, arg, minHoldMillis(req.MinHold)},
			&token, &held, &deadline, &owner, &value, &now, &kept, &shared, &waiting)
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
		he := &sqllock.HeldError{
			Key: req.Key, Owner: owner, Token: token,
			Remaining:     remaining(deadline, now),
			Value:         nonEmpty(value),
			WaitingWriter: waiting,
		}
		if held && owner == "" {
			he.Shared = shared // held shared
		}
		return sqllock.Lease{}, he
	case token == math.MaxInt64:
		return sqllock.Lease{}, fmt.Errorf("%w: key %q", sqllock.ErrTokenExhausted, req.Key)
	default:
		return sqllock.Lease{}, fmt.Errorf("sqllock/sqlite: TryAcquire %q: unexpected row (token %d, held %v, deadline %d, now %d)",
			req.Key, token, held, deadline, now)
	}
}

// TryRenew implements [sqllock.Backend] with one statement (renewSQL).
func (b *Backend) TryRenew(ctx context.Context, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
	if err := sqllock.ValidateLease(l); err != nil {
		return sqllock.Lease{}, err
	}
	if err := sqllock.ValidateTTL(ttl); err != nil {
		return sqllock.Lease{}, err
	}
	if key, _, ok := sqllock.ParseSharedKey(l.Key); ok {
		return b.renewShared(ctx, l, key, ttl)
	}
	var (
		found, held          bool
		token, deadline, now int64
	)
	err := b.write(ctx, outcome.Renew, l.Key, func(ctx context.Context) (err error) {
		found, err = b.queryRow(ctx, outcome.Renew, b.renewSQL, []any{l.Key, l.Token, leaseMillis(ttl)},
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

// Release implements [sqllock.Backend]: one statement (releaseSQL) when the
// lease was held, clean or expired; when it cleared nothing, one read more
// (peekSQL) tells "released twice" by its owner (nil) from a release by
// someone else, a newer token or an unknown one (a [*sqllock.LostError]).
func (b *Backend) Release(ctx context.Context, l sqllock.Lease) error {
	if err := sqllock.ValidateLease(l); err != nil {
		return err
	}
	if key, _, ok := sqllock.ParseSharedKey(l.Key); ok {
		return b.releaseShared(ctx, l, key)
	}
	var result error
	cleared := false
	err := b.write(ctx, outcome.Release, l.Key, func(ctx context.Context) error {
		var deadline, now int64
		found, err := b.queryRow(ctx, outcome.Release, b.releaseSQL, []any{l.Key, l.Token, l.Owner}, &deadline, &now)
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
		found, err = b.queryRow(ctx, outcome.Release, b.peekSQL, []any{l.Key}, &token, &held, &deadline, &owner, &now)
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
		b.signal(l.Key)
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
	if end, ok := keyrange.PrefixEnd(prefix); ok {
		query, args = b.listSQL, []any{prefix, end}
	}
	var out []sqllock.LockInfo
	err := b.read(ctx, outcome.List, prefix, func(ctx context.Context) error {
		out = out[:0]
		stmt, err := b.stmt(ctx, query)
		if err != nil {
			return err
		}
		sctx, args, g, release := shield(ctx, outcome.List, args)
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
			if err := rows.Scan(&i.Key, &i.Token, &i.Owner, &i.Held, &deadline, &now, &i.Value, &i.Shared, &i.WaitingWriter); err != nil {
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
