package postgres

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"time"
)

// Prepared statements under lib/pq (NewDB). lib/pq sends a statement
// with arguments as the unnamed statement, which the server parses and
// plans on every call: for the lock statements (CTEs) that costs more
// than running them. pgx's stdlib driver caches named statements per
// connection itself; under lib/pq the Backend does, with the driver's own
// statements: the first use of a statement on a connection prepares it
// (one round trip more, once), later ones only bind and execute it (one
// round trip). database/sql's *sql.Stmt cannot serve here: the Backend
// runs each statement on a *sql.Conn of its own (see sendDB), and a
// *sql.Stmt runs only on the *sql.DB (which sends a statement again by
// itself when lib/pq reports driver.ErrBadConn, also for a reply lost
// after the server committed) or within the one *sql.Conn it was
// prepared on.
//
// lib/pq names its statements "1", "2", ... per connection: behind a
// pooler that hands a server connection to another client between
// transactions, a name could reach another client's statement of that
// name. So statements are prepared only on a connection that reaches the
// server itself (the pooler check, pooler.go: the backend PID the server
// reports is the one the connection got at its start), never behind a
// pooler, and never with [Options.UnnamedStatements].

// stmtCache keeps the statements prepared on each driver connection of
// db: per connection at most one per statement text (the Backend's
// statements, never one per key), for at most stmtCacheConns connections,
// or twice db's limit of open connections when that is more. database/sql
// does not say when it closes a connection: one that is discarded here
// (a broken one, see discardDB) leaves at once, the others when they are
// the least recently used beyond the bound. A live connection that leaves
// so keeps its statements on the server until it closes; its next
// statement is prepared again, under a new name.
type stmtCache struct {
	mu    sync.Mutex
	conns map[any]*connStmts // by driver connection
	clock uint64
	limit func() int
}

// stmtCacheConns is the least number of connections stmtCache keeps
// statements for.
const stmtCacheConns = 64

// connStmts are the statements prepared on one driver connection, used
// only by whoever holds that connection.
type connStmts struct {
	stmts map[string]driver.Stmt
	used  uint64
}

func newStmtCache(db *sql.DB) *stmtCache {
	return &stmtCache{conns: map[any]*connStmts{}, limit: func() int {
		return max(stmtCacheConns, 2*db.Stats().MaxOpenConnections)
	}}
}

// of returns dc's statements, made empty when dc is new.
func (s *stmtCache) of(dc any) *connStmts {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.clock++
	cs := s.conns[dc]
	if cs == nil {
		if len(s.conns) >= s.limit() {
			var oldest any
			var at uint64
			for k, v := range s.conns {
				if oldest == nil || v.used < at {
					oldest, at = k, v.used
				}
			}
			delete(s.conns, oldest)
		}
		cs = &connStmts{stmts: map[string]driver.Stmt{}}
		s.conns[dc] = cs
	}
	cs.used = s.clock
	return cs
}

// forget drops dc's statements (dc is being discarded).
func (s *stmtCache) forget(dc any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.conns, dc)
}

// size is the number of connections with statements (tests).
func (s *stmtCache) size() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.conns)
}

// named reports whether statements go prepared: under lib/pq, unless
// Options.UnnamedStatements, once the pooler check found the connections
// direct.
func (b *Backend) named() bool { return b.prepared != nil && b.namedOK.Load() }

// queryNamed runs query with args on c as a statement prepared on c's
// driver connection, preparing it there first if it is not yet, and
// scans its rows into dest: with each nil, the first row only
// (sql.ErrNoRows when there is none), else every row, each followed by a
// call of each. A statement the server lost (DISCARD ALL or DEALLOCATE
// on the session: 26000; or whose cached plan no longer fits the table:
// 0A000) failed at its bind, before it ran: it is prepared again and sent
// once more. Every other failure is reported as it came.
func (b *Backend) queryNamed(ctx context.Context, c *sql.Conn, query string, args []any, dest []any, each func() error) error {
	return c.Raw(func(dc any) (err error) {
		defer func() {
			if errors.Is(err, driver.ErrBadConn) {
				b.prepared.forget(dc) // database/sql discards dc
			}
		}()
		cs := b.prepared.of(dc)
		st, fresh, err := cs.prepare(ctx, dc, query)
		if err != nil {
			return err
		}
		err = runStmt(ctx, dc, st, args, dest, each)
		if fresh || !lostStatement(err) {
			return err
		}
		// The server lost it, and with it (DISCARD ALL, DEALLOCATE ALL)
		// most likely the others.
		clear(cs.stmts)
		if st, _, err = cs.prepare(ctx, dc, query); err != nil {
			return err
		}
		return runStmt(ctx, dc, st, args, dest, each)
	})
}

// prepare returns the statement of query on dc, prepared now (fresh)
// unless cs has it. A failure to prepare ran nothing: a server's refusal
// is reported as it is (the missing table, ...), any other failure as not
// sent.
func (cs *connStmts) prepare(ctx context.Context, dc any, query string) (st driver.Stmt, fresh bool, err error) {
	if st := cs.stmts[query]; st != nil {
		return st, false, nil
	}
	pc, ok := dc.(driver.ConnPrepareContext)
	if !ok {
		return nil, false, fmt.Errorf("sqllock/postgres: the driver's connection %T cannot prepare with a context", dc)
	}
	st, err = pc.PrepareContext(ctx, query)
	if err != nil {
		if _, refused := errors.AsType[sqlStateError](err); !refused {
			err = notSentError{fmt.Errorf("preparing the statement: %w", err)}
		}
		return nil, false, err
	}
	if _, ok := st.(driver.StmtQueryContext); !ok {
		_ = st.Close()
		return nil, false, fmt.Errorf("sqllock/postgres: the driver's statement %T cannot query with a context", st)
	}
	cs.stmts[query] = st
	return st, true, nil
}

// lostStatement reports the server's refusal to bind a prepared
// statement that it no longer has (26000) or whose cached plan no
// longer fits (0A000, "cached plan must not change result type"): the
// statement did not run.
func lostStatement(err error) bool {
	se, ok := errors.AsType[sqlStateError](err)
	return ok && (se.SQLState() == "26000" ||
		se.SQLState() == "0A000" && strings.Contains(se.Error(), "cached plan must not change result type"))
}

// runStmt binds args to st on dc and executes it, as database/sql would
// (its argument checks and conversions, its Scan conversions), scanning
// as queryNamed says.
func runStmt(ctx context.Context, dc any, st driver.Stmt, args []any, dest []any, each func() error) error {
	nvs, err := namedValues(dc, args)
	if err != nil {
		return err
	}
	rows, err := st.(driver.StmtQueryContext).QueryContext(ctx, nvs)
	if err != nil {
		return err
	}
	vals := make([]driver.Value, len(rows.Columns()))
	if len(vals) != len(dest) {
		_ = rows.Close()
		return fmt.Errorf("sql: expected %d destination arguments in Scan, not %d", len(vals), len(dest))
	}
	n := 0
	for {
		err := rows.Next(vals)
		if err == io.EOF {
			break
		}
		if err == nil {
			err = scanValues(vals, dest)
		}
		if err == nil && each != nil {
			err = each()
		}
		if err != nil {
			_ = rows.Close()
			return err
		}
		n++
		if each == nil {
			break
		}
	}
	if err := rows.Close(); err != nil {
		return err
	}
	if each == nil && n == 0 {
		return sql.ErrNoRows
	}
	return nil
}

// namedValues are args as database/sql hands them to dc's driver: the
// connection's own check first (lib/pq's turns a slice into an array),
// then database/sql's default conversion.
func namedValues(dc any, args []any) ([]driver.NamedValue, error) {
	checker, _ := dc.(driver.NamedValueChecker)
	out := make([]driver.NamedValue, len(args))
	for i, a := range args {
		nv := driver.NamedValue{Ordinal: i + 1, Value: a}
		err := driver.ErrSkip
		if checker != nil {
			err = checker.CheckNamedValue(&nv)
		}
		if err == driver.ErrSkip {
			nv.Value, err = driver.DefaultParameterConverter.ConvertValue(nv.Value)
		}
		if err != nil {
			return nil, fmt.Errorf("sql: converting argument $%d type: %w", i+1, err)
		}
		out[i] = nv
	}
	return out, nil
}

// scanValues stores a row's values in dest as database/sql's Scan does
// (through sql.Null, whose Scan is database/sql's conversion).
func scanValues(vals []driver.Value, dest []any) error {
	for i, v := range vals {
		var err error
		switch d := dest[i].(type) {
		case *bool:
			err = scanNotNull(d, v)
		case *int64:
			err = scanNotNull(d, v)
		case *int:
			err = scanNotNull(d, v)
		case *string:
			err = scanNotNull(d, v)
		case *time.Time:
			err = scanNotNull(d, v)
		case *[]byte:
			var n sql.Null[[]byte]
			err = n.Scan(v)
			*d = n.V
		case sql.Scanner:
			err = d.Scan(v)
		default:
			err = fmt.Errorf("unsupported Scan destination %T", dest[i])
		}
		if err != nil {
			return fmt.Errorf("sql: Scan error on column index %d: %w", i, err)
		}
	}
	return nil
}

// scanNotNull stores v in d as database/sql's Scan does; NULL is an
// error, as there.
func scanNotNull[T any](d *T, v driver.Value) error {
	if v == nil {
		return fmt.Errorf("converting NULL to %T is unsupported", *d)
	}
	var n sql.Null[T]
	if err := n.Scan(v); err != nil {
		return err
	}
	*d = n.V
	return nil
}

// discardDB makes database/sql close c's driver connection when c is
// closed, and forgets its statements.
func (b *Backend) discardDB(c *sql.Conn) {
	_ = c.Raw(func(dc any) error {
		if b.prepared != nil {
			b.prepared.forget(dc)
		}
		return driver.ErrBadConn
	})
}
