package postgres

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/stdlib"
)

// The Backend on the application's *sql.DB (NewDB). Statements, their
// arguments and the answers are the pgx Backend's (queries/*.sql,
// answer.go, backend.go, batch.go): only how one statement reaches the
// server differs, here, and how the driver's errors read (driverError).

// NewDB returns a Backend that keeps its locks in the table named by opts,
// on db, the application's *sql.DB on PostgreSQL: with pgx's stdlib driver
// (github.com/jackc/pgx/v5/stdlib, as GORM, sqlx, ent and bun open it) or
// lib/pq. It serves the same statements with the same answers as [New]'s
// Backend on a pgx pool, one statement and one round trip per operation
// (see the package doc for what differs). It does no I/O: the first
// statement reads the table's schema version. db stays the caller's:
// Close does not close it, and it must outlive the Backend.
//
// Under pgx's stdlib driver, Watch listens on one connection of db, kept
// out of its pool until Close, and [OnNotice] in the pgx.ConnConfig db was
// opened with lets the Backend see an operator's cancel of a synchronous
// standby wait. Under lib/pq waiters poll, and the Backend prepares each
// statement once per connection, then only binds and executes it (one
// round trip), where the first statement's check finds the connection
// direct to the server; behind a pooler, or with
// [Options.UnnamedStatements], lib/pq sends them unnamed, parsed and
// planned on every call, and needs binary_parameters=yes in the DSN for
// one round trip per statement (behind a pooler in transaction mode, to
// work at all; the first statement checks). See docs/postgres-sqldb.md.
//
// A *sql.DB whose driver is SQLite's is refused at once with an error that
// names sqlite.New.
func NewDB(db *sql.DB, opts Options) (*Backend, error) {
	if db == nil {
		return nil, errors.New("sqllock/postgres: NewDB: nil *sql.DB")
	}
	if err := checkDriver(db.Driver()); err != nil {
		return nil, err
	}
	b, err := newBackend(opts)
	if err != nil {
		return nil, err
	}
	b.db = db
	_, b.pgxDriver = db.Driver().(*stdlib.Driver)
	b.libpq = driverPackage(db.Driver()) == "github.com/lib/pq"
	if b.libpq && !opts.UnnamedStatements {
		b.prepared = newStmtCache(db)
	}
	b.listen = b.notify && b.pgxDriver
	return b, nil
}

// checkDriver refuses a database/sql driver that is not PostgreSQL's, by
// its package, before any I/O.
func checkDriver(d driver.Driver) error {
	if pkg := driverPackage(d); strings.Contains(strings.ToLower(pkg), "sqlite") {
		return fmt.Errorf("sqllock/postgres: NewDB: the *sql.DB's driver is SQLite's (%s): open the Backend with sqlite.New "+
			"(package github.com/ashlock/ashlock/dialect/sqlite)", pkg)
	}
	return nil
}

// driverPackage is the import path of d's package.
func driverPackage(d driver.Driver) string {
	t := reflect.TypeOf(d)
	for t != nil && t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t == nil {
		return ""
	}
	return t.PkgPath()
}

// connDB takes a connection of db for one statement: database/sql sends
// nothing on it until a query. A failure to get one (the pool's wait,
// the dial, the context) is reported as not sent.
func (b *Backend) connDB(ctx context.Context) (*sql.Conn, error) {
	c, err := b.db.Conn(ctx)
	if err != nil {
		return nil, notSentError{err}
	}
	return c, nil
}

// sendDB is send on db: one statement (run) on a connection of its own,
// taken from db for the statement (a *sql.Conn, on which database/sql never
// sends a statement again by itself, as it does on the *sql.DB when the
// driver reports a bad connection), with the pooler check (pooler), the
// resends of conflicts, a condemned session discarded, and a statement
// that succeeded after its context ended reported as unsettled.
func (b *Backend) sendDB(ctx context.Context, pooler bool, run func(*sql.Conn) error) error {
	return b.retryConflicts(ctx, func() error {
		c, err := b.connDB(ctx)
		if err != nil {
			return err
		}
		abandoned := false
		defer func() {
			if !abandoned {
				c.Close()
			}
		}()
		if pooler {
			if err := b.checkPoolerDB(ctx, c); err != nil {
				return err
			}
		}
		if b.pgxDriver {
			_ = c.Raw(func(dc any) error { clearWarning(pgConnOf(dc)); return nil })
		}
		err = b.driverError(b.bounded(ctx, c, run, &abandoned))
		switch {
		case err == nil && b.pgxDriver:
			// A WARNING that OnNotice kept on the connection (the
			// *sql.DB's pgx ConnConfig.OnNotice), or the context ended
			// in flight (syncwait.go).
			_ = c.Raw(func(dc any) error { err = unsettled(ctx, pgConnOf(dc)); return nil })
		case err == nil && ctx.Err() != nil:
			// Answered as committed after the context ended: its wait
			// for the synchronous standbys may have been cancelled.
			err = &unsettledError{ctxErr: ctx.Err()}
		}
		if unusable(err) {
			b.discardDB(c)
		}
		return err
	})
}

// bounded runs run on c, and returns when ctx ends even if run has not:
// lib/pq reads a reply without its context (it sends a cancel request and
// reads on), so on a half-open connection, whose reply never comes, its
// call returns only when the kernel gives the connection up, hours later,
// and a renewal would outlast its lease. An abandoned run keeps c (it is
// closed, and discarded, when run returns: *abandoned tells the caller
// not to close it) and is in flight: its outcome is unknown. pgx's stdlib
// driver ends its calls with their context itself, and runs inline. A
// call answered within cancelGrace after ctx ended has its answer.
func (b *Backend) bounded(ctx context.Context, c *sql.Conn, run func(*sql.Conn) error, abandoned *bool) error {
	if b.pgxDriver || ctx.Done() == nil {
		return run(c)
	}
	done := make(chan error, 1)
	go func() { done <- run(c) }()
	select {
	case err := <-done:
		return err
	case <-ctx.Done():
	}
	// lib/pq's cancel request takes a round trip on a connection of its
	// own; the server's answer that it cancelled the statement (not
	// applied) usually follows within milliseconds.
	grace := time.NewTimer(cancelGrace)
	defer grace.Stop()
	select {
	case err := <-done:
		return err
	case <-grace.C:
	}
	*abandoned = true
	go func() {
		<-done
		b.discardDB(c)
		c.Close()
	}()
	return fmt.Errorf("the driver had not answered when the context ended: %w", ctx.Err())
}

// cancelGrace is how long bounded waits for the driver's answer after the
// context ended, before it abandons the call.
const cancelGrace = 250 * time.Millisecond

// pgConnOf is the *pgconn.PgConn of dc, a driver connection of pgx's
// stdlib driver.
func pgConnOf(dc any) *pgconn.PgConn { return dc.(*stdlib.Conn).Conn().PgConn() }

// queryRowDB is queryRowVia on db (without the aside connection: see the
// package doc).
func (b *Backend) queryRowDB(ctx context.Context, o sendOpts, query string, args []any, dest []any) error {
	args = b.driverArgs(args)
	return b.sendDB(ctx, o.pooler, func(c *sql.Conn) error {
		if b.named() {
			return b.queryNamed(ctx, c, query, args, dest, nil)
		}
		return c.QueryRowContext(ctx, query, args...).Scan(dest...)
	})
}

// queryRowsDB is queryRowsVia on db.
func (b *Backend) queryRowsDB(ctx context.Context, o sendOpts, query string, args []any, dest []any, each func() error) error {
	args = b.driverArgs(args)
	return b.sendDB(ctx, o.pooler, func(c *sql.Conn) error {
		if b.named() {
			return b.queryNamed(ctx, c, query, args, dest, each)
		}
		return scanRows(ctx, c, query, args, dest, each)
	})
}

// listRowsDB is listRows on db: the read is never unsettled.
func (b *Backend) listRowsDB(ctx context.Context, query, prefix string, dest []any, each func() error) error {
	c, err := b.connDB(ctx)
	if err != nil {
		return err
	}
	abandoned := false
	defer func() {
		if !abandoned {
			c.Close()
		}
	}()
	return b.driverError(b.bounded(ctx, c, func(c *sql.Conn) error {
		if b.named() {
			return b.queryNamed(ctx, c, query, []any{prefix}, dest, each)
		}
		return scanRows(ctx, c, query, []any{prefix}, dest, each)
	}, &abandoned))
}

// scanRows runs query on c, scanning each row into dest and calling each.
func scanRows(ctx context.Context, c *sql.Conn, query string, args []any, dest []any, each func() error) error {
	rows, err := c.QueryContext(ctx, query, args...)
	if err != nil {
		return err
	}
	defer rows.Close()
	for rows.Next() {
		if err := rows.Scan(dest...); err != nil {
			return err
		}
		if err := each(); err != nil {
			return err
		}
	}
	if err := rows.Err(); err != nil {
		return err
	}
	return rows.Close()
}

// driverArgs are args as db's driver takes them. pgx's stdlib driver takes
// every argument as pgx does. lib/pq sends a nil element of a [][]byte (a
// batch member's absent value) as an empty bytea: it goes as NULL here,
// as pgx sends it.
func (b *Backend) driverArgs(args []any) []any {
	if b.pgxDriver {
		return args
	}
	for i, a := range args {
		if v, ok := a.([][]byte); ok {
			out := append([]any(nil), args...)
			out[i] = byteaArray(v)
			return out // one bytea array at most (acquire_batch.sql)
		}
	}
	return args
}

// byteaArray is a bytea[] argument in PostgreSQL's text form, a nil
// element as NULL.
type byteaArray [][]byte

func (a byteaArray) Value() (driver.Value, error) {
	var s strings.Builder
	s.WriteByte('{')
	for i, v := range a {
		if i > 0 {
			s.WriteByte(',')
		}
		if v == nil {
			s.WriteString("NULL")
			continue
		}
		s.WriteString(`"\\x`)
		const hex = "0123456789abcdef"
		for _, c := range v {
			s.WriteByte(hex[c>>4])
			s.WriteByte(hex[c&15])
		}
		s.WriteByte('"')
	}
	s.WriteByte('}')
	return s.String(), nil
}

// driverError is err, from db's driver, as the rest of the Backend reads
// errors (translate, isConflict, unusable): database/sql's ErrNoRows is
// pgx's; a server error of another driver than pgx's (lib/pq's *pq.Error)
// also reads as a *pgconn.PgError with its SQLSTATE; and
// driver.ErrBadConn, which pgx's stdlib driver returns only for a
// statement it did not send, is not sent there. lib/pq returns
// driver.ErrBadConn also when the connection broke while it read the
// reply, and for a FATAL server error: on it, the outcome stays unknown.
func (b *Backend) driverError(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, sql.ErrNoRows):
		return pgx.ErrNoRows
	case errors.Is(err, driver.ErrBadConn) && b.pgxDriver:
		return notSentError{err}
	}
	if _, ok := errors.AsType[*pgconn.PgError](err); ok {
		return err
	}
	if se, ok := errors.AsType[sqlStateError](err); ok && se.SQLState() != "" {
		severity := "ERROR"
		if f, ok := se.(interface{ Fatal() bool }); ok && f.Fatal() {
			severity = "FATAL"
		}
		return &serverError{err: err, pg: &pgconn.PgError{Code: se.SQLState(), Message: err.Error(), Severity: severity}}
	}
	return err
}

// sqlStateError is a server's error with its SQLSTATE, as lib/pq's
// *pq.Error is.
type sqlStateError interface {
	error
	SQLState() string
}

// serverError is a server's error as another driver than pgx's reports
// it, with its SQLSTATE as a *pgconn.PgError beside it.
type serverError struct {
	err error
	pg  *pgconn.PgError
}

func (e *serverError) Error() string   { return e.err.Error() }
func (e *serverError) Unwrap() []error { return []error{e.err, e.pg} }

// readVersionDB is readVersion on db: in the pooler check's round trip
// under pgx's stdlib driver, else alone.
func (b *Backend) readVersionDB(ctx context.Context) (int, error) {
	c, err := b.db.Conn(ctx)
	if err != nil {
		return 0, err
	}
	defer c.Close()
	res, err := b.checkPoolerDBWith(ctx, c, b.full.schema)
	if err != nil {
		return 0, b.driverError(err)
	}
	if res != nil {
		if res.Err != nil {
			return 0, res.Err
		}
		if len(res.Rows) != 1 || len(res.Rows[0]) != 1 {
			return 0, fmt.Errorf("sqllock/postgres: schema version: unexpected result %q", res.Rows)
		}
		return versionOf(string(res.Rows[0][0]))
	}
	var v string
	if err := c.QueryRowContext(ctx, b.full.schema).Scan(&v); err != nil {
		return 0, b.driverError(err)
	}
	return versionOf(v)
}

// versionOf is the schema version the schema statement answered.
func versionOf(s string) (int, error) {
	v, err := strconv.Atoi(s)
	if err == nil && (v < 2 || v > latest) {
		err = fmt.Errorf("sqllock/postgres: schema version %d read", v)
	}
	return v, err
}

// listenConnDB runs session on a connection of db of its own, under pgx's
// stdlib driver (which reaches its *pgx.Conn); the connection is
// discarded after, never returned to db's pool.
func (b *Backend) listenConnDB(ctx context.Context, session func(*pgx.Conn) error) error {
	c, err := b.db.Conn(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	var serr error
	_ = c.Raw(func(dc any) error {
		serr = session(dc.(*stdlib.Conn).Conn())
		return driver.ErrBadConn // a session that listened never goes back
	})
	return serr
}
