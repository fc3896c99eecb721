package cli

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/ashlock/ashlock/dialect/postgres"
	"github.com/ashlock/ashlock/dialect/sqlite"
	"github.com/ashlock/ashlock/internal/wait"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// session is what a command that works on locks opens: the database its
// flags name, the lock backend on it, and a Client when the command asks
// for one. close closes what was opened, the Client first.
type session struct {
	db      *database
	backend *backend
	client  *sqllock.Client // nil unless openOptions.client was set
}

// openOptions say how a command opens its session.
type openOptions struct {
	// maxConns sizes the PostgreSQL pool (0: pgx's default).
	maxConns int
	// readOnly opens a SQLite file this process cannot write read-only
	// (list, leader): see openReadOnly.
	readOnly bool
	// client, when set, gives the Options of the session's Client.
	client func(d *database) sqllock.Options
}

// open validates f, resolves the database, opens the backend and, if
// asked, a Client on it: the one way every command but migrate gets to its
// locks.
func (e *env) open(ctx context.Context, f dbFlags, o openOptions) (*session, error) {
	d, err := e.database(f)
	if err != nil {
		return nil, err
	}
	openBackend := e.openBackend
	if o.readOnly {
		openBackend = e.openReadOnly
	}
	b, err := openBackend(ctx, d, f, o.maxConns)
	if err != nil {
		return nil, err
	}
	s := &session{db: d, backend: b}
	if o.client != nil {
		// The dialect's Backend itself, not b: the Client looks for what
		// it can do beyond sqllock.Backend (Watcher, BatchRenewer,
		// PermitAcquirer), which the wrapper would hide.
		if s.client, err = sqllock.New(b.Backend, o.client(d)); err != nil {
			b.close()
			return nil, fail(ExitUsage, "%v", err)
		}
	}
	return s, nil
}

// close closes the Client, then the backend.
func (s *session) close() {
	if s.client != nil {
		_ = s.client.Close(context.Background())
	}
	s.backend.close()
}

// prepareSQLite creates the default file's directory (0700), and checks that
// a given file's directory exists, so that SQLite's "unable to open database
// file" comes with its reason.
func (d *database) prepareSQLite() error {
	dir := filepath.Dir(d.path)
	if d.defaultPath {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return fail(ExitUnavailable, "cannot create the state directory for the embedded SQLite file: %v", err)
		}
		return nil
	}
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		return fail(ExitConfig, "cannot open %s: directory %s does not exist (create it, or use another path)", d.display, dir)
	}
	return nil
}

// backend is an open lock backend and what closes it.
type backend struct {
	sqllock.Backend
	close func()
}

// openBackend opens the lock backend. SQLite files are created and migrated
// on first use; PostgreSQL needs `sqllock migrate up` first. maxConns sizes
// the PostgreSQL pool (0: pgx's default).
func (e *env) openBackend(ctx context.Context, d *database, f dbFlags, maxConns int) (*backend, error) {
	if d.ext != nil {
		return e.openDialect(ctx, d, f)
	}
	switch d.dialect {
	case migrations.SQLite:
		if f.schema != "" {
			return nil, fail(ExitUsage, "--schema is for PostgreSQL; SQLite has no schemas")
		}
		if err := d.prepareSQLite(); err != nil {
			return nil, err
		}
		b, err := sqlite.Open(d.path, sqlite.Options{Table: f.table})
		if err != nil {
			return nil, e.openError(d, err)
		}
		return &backend{Backend: b, close: func() { _ = b.Close() }}, nil
	case migrations.MariaDB:
		return e.openMariaDB(ctx, d, f, maxConns)
	default:
		pool, err := e.connectPG(ctx, d, maxConns)
		if err != nil {
			return nil, err
		}
		b, err := postgres.New(pool, postgres.Options{Schema: f.schema, Table: f.table, DisableNotify: f.noNotify, Logger: e.log})
		if err != nil {
			pool.Close()
			return nil, err
		}
		return &backend{Backend: b, close: func() { _ = b.Close(); pool.Close() }}, nil
	}
}

// openReadOnly opens the lock backend for inspection (list, leader): as
// openBackend does, except that a SQLite file this process cannot write is
// opened read-only (and not migrated) instead of refused, so that it can be
// read. A file it can write is opened, and migrated on first use, as
// always: a lock table not created yet then lists nothing.
func (e *env) openReadOnly(ctx context.Context, d *database, f dbFlags, maxConns int) (*backend, error) {
	if d.dialect != migrations.SQLite || f.schema != "" {
		return e.openBackend(ctx, d, f, maxConns)
	}
	if err := d.prepareSQLite(); err != nil {
		return nil, err
	}
	b, err := sqlite.Open(d.path, sqlite.Options{Table: f.table})
	if errors.Is(err, sqlite.ErrUnusable) {
		if ro, rerr := sqlite.Open(d.path, sqlite.Options{Table: f.table, ReadOnly: true}); rerr == nil {
			return &backend{Backend: ro, close: func() { _ = ro.Close() }}, nil
		}
	}
	if err != nil {
		return nil, e.openError(d, err) // what the read-write open said
	}
	return &backend{Backend: b, close: func() { _ = b.Close() }}, nil
}

// connectPG opens a pool and checks that the server answers, within the
// connect timeout and ctx's deadline, whichever ends first. For run
// --wait (e.waitProgress, ctx's deadline the end of the wait), a server that cannot be reached is tried again
// with backoff until the deadline: the wait is spent waiting for the
// database as well as for the lock. A server that refuses the credentials
// or does not have the database fails at once, as a configuration error.
func (e *env) connectPG(ctx context.Context, d *database, maxConns int) (*pgxpool.Pool, error) {
	var pool *pgxpool.Pool
	err := e.connecting(ctx, func() (err error) {
		pool, err = e.connectPGOnce(ctx, d, maxConns)
		return err
	})
	return pool, err
}

// connecting runs once, a connection attempt, until it succeeds or fails
// otherwise than ExitUnavailable, or, unless run --wait asked for it,
// once.
func (e *env) connecting(ctx context.Context, once func() error) error {
	_, hasDeadline := ctx.Deadline()
	retry := e.waitProgress && hasDeadline
	start := time.Now()
	var printed time.Time
	for attempt := 1; ; attempt++ {
		err := once()
		var xe *exitError
		if err == nil || !retry || !errors.As(err, &xe) || xe.code != ExitUnavailable {
			return err
		}
		pause := sqllock.DefaultBackoff(attempt) * 20 // about 0.1s, doubling, up to 5s
		dl, _ := ctx.Deadline()
		over := time.Until(dl) <= pause
		if !over && (attempt == 1 || time.Since(printed) >= progressEvery) {
			e.progressf("sqllock %s: %v; trying again until the --wait ends", e.cmdName, xe.err)
			printed = time.Now()
		}
		// The wait ends (or will before the next attempt): sleep to its end.
		_ = wait.Sleep(ctx, min(pause, max(time.Until(dl), 0)))
		if ctx.Err() != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return ctx.Err() // interrupted
		}
		if over {
			// What it found, and for how long it tried.
			return fail(ExitUnavailable, "%v; gave up after trying for %v (%d attempts, --wait)", xe.err, time.Since(start).Round(100*time.Millisecond), attempt)
		}
	}
}

// connectPGOnce is one attempt of connectPG.
func (e *env) connectPGOnce(ctx context.Context, d *database, maxConns int) (*pgxpool.Pool, error) {
	cfg := d.pg.Copy()
	if maxConns > 0 {
		cfg.MaxConns = int32(maxConns)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fail(ExitConfig, "PostgreSQL at %s: %v", d.display, err)
	}
	bound, why := cfg.ConnConfig.ConnectTimeout, "the connect timeout"
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < bound {
		bound, why = time.Until(dl), "the command's --wait"
	}
	pctx, cancel := context.WithTimeout(ctx, cfg.ConnConfig.ConnectTimeout)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		if ctx.Err() != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return nil, ctx.Err() // interrupted
		}
		if code, what := refusedConfig(err); code != "" {
			return nil, fail(ExitConfig, "PostgreSQL at %s refused the connection: %s (SQLSTATE %s): %s; waiting will not change that: check the URL, the PG* variables and ~/.pgpass",
				d.display, what, code, connectErrorText(err))
		}
		if pctx.Err() != nil || errors.Is(err, context.DeadlineExceeded) || pgconn.Timeout(err) {
			return nil, fail(ExitUnavailable, "cannot reach PostgreSQL at %s: no answer within %v (%s)",
				d.display, bound.Round(100*time.Millisecond), why)
		}
		return nil, fail(ExitUnavailable, "cannot reach PostgreSQL at %s: %s (check the URL, the PG* variables and that the server is up)", d.display, connectErrorText(err))
	}
	return pool, nil
}

// refusedConfig reports the SQLSTATE and its meaning when the server
// answered a connection with an error that only a change of configuration
// mends: the credentials refused, the database missing.
func refusedConfig(err error) (code, what string) {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		return "", ""
	}
	switch pe.Code {
	case "28P01":
		return pe.Code, "wrong password"
	case "28000":
		return pe.Code, "the user may not connect (pg_hba.conf, or no such role)"
	case "3D000":
		return pe.Code, "the database does not exist"
	}
	return "", ""
}

// connectErrorText is pgx's connect error without its repetitions: pgx
// lists every attempt (with and without TLS, each address), and they often
// fail the same way.
func connectErrorText(err error) string {
	var ce *pgconn.ConnectError
	if !errors.As(err, &ce) {
		return err.Error()
	}
	var parts []string
	seen := map[string]bool{}
	var add func(error)
	add = func(err error) {
		if j, ok := err.(interface{ Unwrap() []error }); ok {
			for _, e := range j.Unwrap() {
				add(e)
			}
			return
		}
		if t := err.Error(); !seen[t] {
			seen[t] = true
			parts = append(parts, t)
		}
	}
	if inner := ce.Unwrap(); inner != nil {
		add(inner)
	}
	return fmt.Sprintf("user=%s database=%s: %s", ce.Config.User, ce.Config.Database, strings.Join(parts, "; "))
}

// opContext bounds one statement of a command that sends a few (list,
// release) by the connect timeout: a server that stopped answering fails
// the command instead of hanging it. SQLite bounds its own waits.
func (d *database) opContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if d.connectTimeout() == 0 {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, d.connectTimeout())
}

// openSQL opens a database/sql handle for the migrations.
func (e *env) openSQL(ctx context.Context, d *database, schema string) (*sql.DB, func(), error) {
	switch d.dialect {
	case migrations.SQLite:
		if schema != "" {
			return nil, nil, fail(ExitUsage, "--schema is for PostgreSQL; SQLite has no schemas")
		}
		if err := d.prepareSQLite(); err != nil {
			return nil, nil, err
		}
		dsn, err := sqlite.DSN(d.path, sqlite.Options{})
		if err != nil {
			return nil, nil, e.openError(d, err)
		}
		db, err := sql.Open("sqlite", dsn)
		if err != nil {
			return nil, nil, e.openError(d, err)
		}
		db.SetMaxOpenConns(1)
		return db, func() { _ = db.Close() }, nil
	case migrations.MariaDB:
		if schema != "" {
			return nil, nil, fail(ExitUsage, "--schema is for PostgreSQL; on MariaDB the URL's database holds the lock table")
		}
		db, err := e.connectMariaDB(ctx, d, 2, true)
		if err != nil {
			return nil, nil, err
		}
		return db, func() { _ = db.Close() }, nil
	default:
		pool, err := e.connectPG(ctx, d, 2)
		if err != nil {
			return nil, nil, err
		}
		db := stdlib.OpenDBFromPool(pool)
		return db, func() { _ = db.Close(); pool.Close() }, nil
	}
}

func (e *env) openError(d *database, err error) error {
	code := ExitUnavailable
	if errors.Is(err, sqlite.ErrInMemory) || errors.Is(err, sqlite.ErrUnusable) {
		code = ExitConfig
	}
	if errors.Is(err, migrations.ErrInvalidIdentifier) {
		code = ExitUsage
	}
	return fail(code, "cannot open %s: %v", d.display, err)
}
