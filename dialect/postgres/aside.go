package postgres

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
)

// asideFor is how long renewals stay on the aside connection after a
// statement on the pool was abandoned: longer than pgx keeps the pool slot
// of a connection it closes while the connection is still draining (up to
// 15 s), so that the pool has its slots back when renewals return to it.
const asideFor = 20 * time.Second

// aside is a connection of the Backend's own for renewals and releases,
// used while the application's pool is suspect.
//
// A pooled connection that goes half-open (a NAT or firewall that dropped
// its state, a failover without a reset) never answers: the Client
// abandons a renewal sent on it at the attempt's bound and sends it again.
// The pool cannot be relied on for that retry: pgx, closing the abandoned
// connection, keeps its slot until the socket has drained (up to 15 s), and
// the pool's other idle connections are likely half-open too (each costs
// an attempt, with a ping that hangs before it). So from the first
// statement abandoned on the pool (its context ended while it waited for a
// connection or for the reply) and for asideFor, renewals (only they: they
// are few, batched, and what keeps leases) go over a connection dialed
// here from the pool's configuration, one statement at a time. An aside
// connection that fails or is abandoned is closed and dialed again by the
// next renewal. Acquires and releases stay on the pool: a lost acquire or
// release costs a wait, never a lease.
type aside struct {
	sem chan struct{} // one statement at a time; made on first use

	mu     sync.Mutex // guards the fields below
	until  time.Time  // renewals go aside until then
	conn   *pgx.Conn  // nil until dialed, and after a failure
	closed bool
}

// noteAbandoned marks the pool suspect if ctx has ended: a statement on
// the pool was given up (not sent, or no reply in time).
func (a *aside) noteAbandoned(ctx context.Context) {
	if !errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return // a caller that cancels says nothing about the pool
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if !a.closed {
		a.until = time.Now().Add(asideFor)
		if a.sem == nil {
			a.sem = make(chan struct{}, 1)
		}
	}
}

// active reports whether renewals go aside now. When the time has passed,
// it closes the aside connection.
func (a *aside) active() bool {
	a.mu.Lock()
	if a.until.IsZero() {
		a.mu.Unlock()
		return false
	}
	if time.Now().Before(a.until) {
		a.mu.Unlock()
		return true
	}
	a.until = time.Time{}
	conn := a.takeLocked()
	a.mu.Unlock()
	discardQuietly(conn)
	return false
}

// run runs one statement on the aside connection, dialing it first if it
// has none. A statement that fails for its connection or its context
// costs the connection: the next one dials anew.
func (a *aside) run(ctx context.Context, b *Backend, run func(*pgx.Conn) error) error {
	select {
	case a.sem <- struct{}{}:
	case <-ctx.Done():
		return notSentError{ctx.Err()}
	}
	defer func() { <-a.sem }()
	a.mu.Lock()
	conn, closed := a.conn, a.closed
	a.mu.Unlock()
	if closed {
		return notSentError{errors.New("sqllock/postgres: backend closed")}
	}
	if conn == nil || conn.IsClosed() {
		var err error
		conn, err = pgx.ConnectConfig(ctx, b.pool.Config().ConnConfig)
		if err != nil {
			return notSentError{err}
		}
		a.mu.Lock()
		if a.closed {
			a.mu.Unlock()
			discard(ctx, conn)
			return notSentError{errors.New("sqllock/postgres: backend closed")}
		}
		a.conn = conn
		a.mu.Unlock()
	}
	err := runOn(ctx, conn, run)
	if err != nil && (ctx.Err() != nil || unusable(err) || conn.IsClosed() || conn.PgConn().IsBusy() || conn.PgConn().TxStatus() != 'I') {
		a.mu.Lock()
		var drop *pgx.Conn
		if a.conn == conn {
			drop = a.takeLocked()
		}
		a.mu.Unlock()
		discardQuietly(drop)
	}
	return err
}

// takeLocked takes the aside connection away, for the caller to close
// once a.mu is released. Called with a.mu held.
func (a *aside) takeLocked() *pgx.Conn {
	conn := a.conn
	a.conn = nil
	return conn
}

// discardQuietly closes conn (nil: nothing), bounded as discard is.
func discardQuietly(conn *pgx.Conn) {
	if conn != nil {
		discard(context.Background(), conn)
	}
}

// close closes the aside connection for good (Backend.Close).
func (a *aside) close() {
	a.mu.Lock()
	a.closed = true
	a.until = time.Time{}
	conn := a.takeLocked()
	a.mu.Unlock()
	discardQuietly(conn)
}
