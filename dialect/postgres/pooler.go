package postgres

import (
	"cmp"
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
)

// ErrPoolerSettings means that the pool reaches PostgreSQL through a
// connection pooler in transaction mode (PgBouncer with pool_mode =
// transaction, and the like) with settings that do not work there; the
// error says which and how to change them. No statement was applied.
//
// In transaction mode a client connection gets a server connection for one
// transaction at a time, so nothing of a session survives from one
// statement to the next:
//   - pgx's default QueryExecModeCacheStatement prepares named statements
//     on the server connection it happens to have, and later finds them
//     missing ("prepared statement does not exist") or meets another
//     client's ("already exists"). Set default_query_exec_mode=exec in the
//     connection string (or cache_describe, or simple_protocol; or
//     pgxpool.Config.ConnConfig.DefaultQueryExecMode). PgBouncer 1.21 and
//     later keep named statements across server connections when
//     max_prepared_statements > 0: the Backend then finds them working and
//     does not complain.
//   - LISTEN registers a server connection that goes back to the pool at
//     once: release notifications never arrive (waiters fall back to
//     polling), and the pooled connection receives them instead. Set
//     [Options.DisableNotify].
//
// The Backend checks with its first statement (one query more on a direct
// connection; a few more, and a second connection for a moment, when the
// connection's backend PID is not the server's, as behind any pooler).
// What it cannot see: transaction pooling that a busy pooler happens to
// hide from the check (each of the check's two clients keeps finding its
// own server connection). Then nothing is reported until a statement meets
// a prepared statement that is missing or another client's, which is
// reported with this error too; LISTEN left on then goes unnoticed, and
// waiters poll.
var ErrPoolerSettings = errors.New("sqllock/postgres: the pool's settings do not work through a pooler in transaction mode")

// pooler is what the Backend learned about the path to the server: the
// check runs once, on the first connection a statement takes from the
// pool (see Backend.checkPoolerWith).
type pooler struct {
	done     atomic.Bool
	mu       sync.Mutex        // held by the check while it runs; guards the rest
	execMode pgx.QueryExecMode // the pool's default
	failures int               // checks that could not tell
	err      error             // the misconfiguration found, nil when none
}

const (
	// poolerProbeTimeout bounds one check, whatever the caller's context.
	poolerProbeTimeout = 2 * time.Second
	// poolerProbeAttempts bounds the checks that could not tell (the
	// server down, the context ended, a pooler that refuses the probe's
	// statements) before the Backend stops checking.
	poolerProbeAttempts = 3
)

// checkedConn takes a connection of the pool for a statement and runs
// the pooler check on it, sending also in the check's round trip (see
// checkPoolerWith). A check that its own bound ended leaves its
// connection closed (pgx closes one whose reply did not come in time):
// the statement then goes on another connection, checked again while
// checks are due, so that a server that stalls costs the caller's
// context, never a statement sent on a closed connection. On error, c is
// nil and nothing was sent but (perhaps) a check.
func (b *Backend) checkedConn(ctx context.Context, also string) (c *pgxpool.Conn, res *pgconn.Result, err error) {
	for range poolerProbeAttempts + 1 {
		c, err = b.pool.Acquire(ctx)
		if err != nil {
			return nil, nil, err
		}
		res, err = b.checkPoolerWith(ctx, c, also)
		if err != nil {
			c.Release()
			return nil, nil, err
		}
		if !c.Conn().IsClosed() {
			return c, res, nil
		}
		c.Release()
	}
	return nil, nil, errors.New("sqllock/postgres: every connection taken from the pool closed during the pooler check")
}

// checkPoolerWith tells, once per Backend, whether the pool's connections go
// through a pooler in transaction mode with settings that cannot work there
// (see ErrPoolerSettings), using c, a connection just taken from the pool
// for a statement, and one more connection for a moment. It returns the
// misconfiguration it found, or nil. It costs nothing when neither setting
// could be wrong (an exec mode without named statements and notifications
// off), and one round trip, once, on a direct connection to PostgreSQL.
// While one statement checks, the others go ahead unchecked (they hold
// connections the check may need).
//
// A pooler is recognised by the backend PID: PgBouncer (like most poolers)
// hands its clients a made-up one, and pg_backend_pid() tells the real
// one. Transaction mode is recognised by a server connection changing
// hands: after c's statement, a second client connection opens a
// transaction, and c asks again; in session mode c keeps its server
// connection and the other client never gets it, while in transaction mode
// PgBouncer by default hands the server connection just released to the
// next client (server_round_robin = 0), so the second client gets c's, or
// c gets another. A busy pooler can hide it (both happen to keep or find
// their own): then nothing is reported here, and a statement that meets a
// missing or foreign prepared statement still reports ErrPoolerSettings
// (see translatePg). Whether named prepared statements survive the change
// of server connection is tried, not inferred from a version.
//
// A check that cannot tell (a connection problem, the context) reports
// nothing: the statement then runs, and the next one checks again, up to
// poolerProbeAttempts times.
//
// When the check runs, it sends also (a statement without parameters, or
// "") in the probe's first round trip and returns its result; nil when the
// check did not run.
func (b *Backend) checkPoolerWith(ctx context.Context, c *pgxpool.Conn, also string) (*pgconn.Result, error) {
	if b.poolerCheck.done.Load() {
		return nil, b.poolerCheck.err // without pool.Config, which copies the configuration
	}
	return b.checkPoolerOn(ctx, c.Conn(), b.pool.Config().ConnConfig.DefaultQueryExecMode, b.poolOther, also)
}

// withOther runs f on a second connection of the Backend's pool, taken for
// the pooler probe's moment.
type withOther func(ctx context.Context, f func(*pgx.Conn) error) error

// poolOther is withOther on the pgx pool.
func (b *Backend) poolOther(ctx context.Context, f func(*pgx.Conn) error) error {
	c, err := b.pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer c.Release()
	return f(c.Conn())
}

// checkPoolerOn is checkPoolerWith on conn, whose default exec mode is
// execMode, taking the probe's second connection through other.
func (b *Backend) checkPoolerOn(ctx context.Context, conn *pgx.Conn, execMode pgx.QueryExecMode, other withOther, also string) (*pgconn.Result, error) {
	if b.poolerCheck.done.Load() {
		return nil, b.poolerCheck.err
	}
	if !b.poolerCheck.mu.TryLock() {
		return nil, nil
	}
	defer b.poolerCheck.mu.Unlock()
	if b.poolerCheck.done.Load() {
		return nil, b.poolerCheck.err
	}
	b.poolerCheck.execMode = execMode
	if b.poolerCheck.execMode != pgx.QueryExecModeCacheStatement && !b.listen {
		b.poolerCheck.done.Store(true)
		return nil, nil
	}
	pctx, cancel := context.WithTimeout(ctx, poolerProbeTimeout)
	defer cancel()
	found, res, err := probePooler(pctx, conn.PgConn(), other, also)
	if err != nil {
		b.poolerCheck.failures++
		if b.poolerCheck.failures >= poolerProbeAttempts {
			b.poolerCheck.done.Store(true)
		}
		return res, nil
	}
	b.poolerCheck.err = b.poolerError(found)
	b.poolerCheck.done.Store(true)
	return res, b.poolerCheck.err
}

// poolerFound is what probePooler found.
type poolerFound struct {
	pooler      bool // the PID the connection reports is not its server's
	transaction bool // server connections change hands between transactions
	namedLost   bool // a named prepared statement did not follow the client
}

// poolerError turns what the probe found into the error for this
// Backend's settings, or nil.
func (b *Backend) poolerError(f poolerFound) error {
	if !f.transaction && !f.namedLost {
		return nil
	}
	var fixes []string
	if f.namedLost && b.poolerCheck.execMode == pgx.QueryExecModeCacheStatement {
		fixes = append(fixes, "pgx's QueryExecModeCacheStatement (its default) needs named prepared statements, which the pooler does not keep "+
			"between transactions: set default_query_exec_mode=exec (or cache_describe, or simple_protocol) in the connection string, "+
			"or pgxpool.Config.ConnConfig.DefaultQueryExecMode")
	}
	if f.transaction && b.listen {
		fixes = append(fixes, "LISTEN needs a session of its own, which a pooler in transaction mode does not give: set postgres.Options{DisableNotify: true}")
	}
	if len(fixes) == 0 {
		return nil
	}
	return fmt.Errorf("%w: the pool's connections go through a pooler in transaction mode (PgBouncer?): %s",
		ErrPoolerSettings, strings.Join(fixes, "; "))
}

// probePooler runs the probe described at checkPoolerWith on conn (idle, out of
// a transaction), taking a second connection through other for a moment. The
// first round trip also sends also, if not "", and returns its result
// (with its error, if it failed) whatever the probe finds.
func probePooler(ctx context.Context, conn *pgconn.PgConn, other withOther, also string) (f poolerFound, alsoRes *pgconn.Result, err error) {
	q, want := "SELECT pg_backend_pid()", 1
	if also != "" {
		q, want = q+";\n"+also, 2
	}
	results, err := conn.Exec(ctx, q).ReadAll()
	if also != "" && len(results) == want {
		alsoRes = results[1]
	}
	if len(results) == 0 || results[0].Err != nil {
		return f, alsoRes, cmp.Or(err, fmt.Errorf("pooler probe: %d results", len(results)))
	}
	if pid, err := onePID(results[0].Rows); err != nil || pid == conn.PID() {
		return f, alsoRes, err // the server itself (or an error)
	}
	f.pooler = true
	var rnd [6]byte
	_, _ = rand.Read(rnd[:])
	name := "sqllock_pooler_probe_" + hex.EncodeToString(rnd[:])
	if _, err := conn.Prepare(ctx, name, "SELECT pg_backend_pid()", nil); err != nil {
		return f, alsoRes, err
	}
	defer func() {
		// Closing a statement the server connection does not have is no
		// error. On a server connection that went back to a transaction
		// pooler the statement stays, under its random name, until that
		// connection closes.
		_ = conn.Deallocate(ctx, name)
	}()
	first, err := prepared(ctx, conn, name)
	if errors.Is(err, errNamedLost) {
		// Lost between two round trips already.
		f.transaction, f.namedLost = true, true
		return f, alsoRes, nil
	}
	if err != nil {
		return f, alsoRes, err
	}
	err = other(ctx, func(oc *pgx.Conn) error {
		tx, err := oc.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
			defer cancel()
			_ = tx.Rollback(rctx)
		}()
		var second uint32
		if err := tx.QueryRow(ctx, "SELECT pg_backend_pid()", pgx.QueryExecModeSimpleProtocol).Scan(&second); err != nil {
			return err
		}
		again, err := prepared(ctx, conn, name)
		switch {
		case errors.Is(err, errNamedLost):
			f.transaction, f.namedLost = true, true
		case err != nil:
			return err
		default:
			f.transaction = second == first || again != first
		}
		if second == first {
			// The other client has the server connection with the probe's
			// statement: drop it there.
			_, _ = tx.Exec(ctx, "DEALLOCATE "+name, pgx.QueryExecModeSimpleProtocol)
		}
		return nil
	})
	return f, alsoRes, err
}

// errNamedLost: the probe's named prepared statement was missing.
var errNamedLost = errors.New("named prepared statement lost")

// prepared runs the probe's named statement on conn and returns the
// backend PID it reads.
func prepared(ctx context.Context, conn *pgconn.PgConn, name string) (uint32, error) {
	res := conn.ExecPrepared(ctx, name, nil, nil, nil).Read()
	if pgErr, ok := errors.AsType[*pgconn.PgError](res.Err); ok && pgErr.Code == "26000" {
		return 0, errNamedLost
	}
	if res.Err != nil {
		return 0, res.Err
	}
	return onePID(res.Rows)
}

// onePID reads the one backend PID of a probe's result.
func onePID(rows [][][]byte) (uint32, error) {
	if len(rows) != 1 || len(rows[0]) != 1 {
		return 0, fmt.Errorf("pooler probe: unexpected result %q", rows)
	}
	pid, err := strconv.ParseUint(string(rows[0][0]), 10, 32)
	return uint32(pid), err
}

// isForeignStatement reports the server's refusal of a pgx statement-cache
// statement that the server connection does not have (26000) or has from
// another client (42P05): what a pooler in transaction mode does to
// QueryExecModeCacheStatement. Nothing was executed.
func isForeignStatement(pgErr *pgconn.PgError) bool {
	return (pgErr.Code == "26000" || pgErr.Code == "42P05") && strings.Contains(pgErr.Message, `"stmtcache_`)
}

// checkPoolerDB is checkPoolerWith on db: under pgx's stdlib driver, the same
// probe on the *pgx.Conn that c reaches, its second connection taken from
// db; under lib/pq, checkPoolerLibPQ.
func (b *Backend) checkPoolerDB(ctx context.Context, c *sql.Conn) error {
	_, err := b.checkPoolerDBWith(ctx, c, "")
	return err
}

// checkPoolerDBWith is checkPoolerWith on db.
func (b *Backend) checkPoolerDBWith(ctx context.Context, c *sql.Conn, also string) (res *pgconn.Result, err error) {
	if b.poolerCheck.done.Load() {
		return nil, b.poolerCheck.err
	}
	if !b.pgxDriver {
		return nil, b.checkPoolerLibPQ(ctx, c)
	}
	if b.db.Stats().MaxOpenConnections == 1 {
		// The probe needs a second connection, which would wait for c
		// until the probe's timeout on each attempt: not checked (under
		// pgx a foreign prepared statement still reports
		// ErrPoolerSettings, see translatePg).
		b.poolerCheck.done.Store(true)
		return nil, nil
	}
	rawErr := c.Raw(func(dc any) error {
		conn := dc.(*stdlib.Conn).Conn()
		res, err = b.checkPoolerOn(ctx, conn, conn.Config().DefaultQueryExecMode, b.dbOther, also)
		return nil
	})
	if rawErr != nil {
		return nil, rawErr
	}
	return res, err
}

// dbOther is withOther on db: a second connection of db, its *pgx.Conn.
func (b *Backend) dbOther(ctx context.Context, f func(*pgx.Conn) error) error {
	c, err := b.db.Conn(ctx)
	if err != nil {
		return err
	}
	defer c.Close()
	return c.Raw(func(dc any) error { return f(dc.(*stdlib.Conn).Conn()) })
}

// checkPoolerLibPQ is the pooler check of lib/pq, once per Backend.
// First, whether c reaches the server itself: the backend PID the server
// reports is the one lib/pq was given at the connection's start (one
// round trip). Only then are statements prepared (b.namedOK, see
// prepared.go): behind a pooler, lib/pq's statement names ("1", "2", ...
// per connection) could meet another client's statement of that name.
//
// Behind a pooler, lib/pq without binary_parameters=yes sends each
// statement with arguments in two round trips (prepare the unnamed
// statement, then bind and execute it): a pooler in transaction mode may
// hand them to different server connections, and the bind then meets
// another client's unnamed statement (measured through PgBouncer: "bind
// message supplies 5 parameters, but prepared statement \"\" requires
// 1", or "unnamed prepared statement does not exist"), or, where the
// counts match, runs it. Transaction pooling is recognised as
// checkPoolerWith does, by a server connection changing hands (two round
// trips more and a second connection, once), and refused with
// ErrPoolerSettings. Other drivers are not checked.
func (b *Backend) checkPoolerLibPQ(ctx context.Context, c *sql.Conn) error {
	if !b.libpq {
		b.poolerCheck.done.Store(true)
		return nil
	}
	if !b.poolerCheck.mu.TryLock() {
		return nil
	}
	defer b.poolerCheck.mu.Unlock()
	if b.poolerCheck.done.Load() {
		return b.poolerCheck.err
	}
	binary := binaryParameters(c)
	if binary && b.prepared == nil {
		// Unnamed statements in one round trip: they work anywhere.
		b.poolerCheck.done.Store(true)
		return nil
	}
	pctx, cancel := context.WithTimeout(ctx, poolerProbeTimeout)
	defer cancel()
	failed := func() error {
		b.poolerCheck.failures++
		if b.poolerCheck.failures >= poolerProbeAttempts {
			b.poolerCheck.done.Store(true) // and unnamed statements
		}
		return nil
	}
	direct, err := directLibPQ(pctx, c)
	if err != nil {
		return failed()
	}
	if direct || binary || b.db.Stats().MaxOpenConnections == 1 {
		// Direct: prepared statements (unless unnamed ones were asked
		// for). Behind a pooler, unnamed ones: with binary parameters
		// they work in any pool mode; without, transaction pooling is not
		// checked when the probe's second connection would wait for c
		// until its timeout.
		b.namedOK.Store(direct && b.prepared != nil)
		b.poolerCheck.done.Store(true)
		return nil
	}
	transaction, err := probeTransactionPooling(pctx, c, b.db)
	if err != nil {
		return failed()
	}
	if transaction {
		b.poolerCheck.err = fmt.Errorf("%w: the *sql.DB's connections go through a pooler in transaction mode (PgBouncer?): "+
			"lib/pq without binary_parameters=yes prepares each statement in one transaction and runs it in the next, which the pooler "+
			"may send to another server connection: add binary_parameters=yes to the connection string", ErrPoolerSettings)
	}
	b.poolerCheck.done.Store(true)
	return b.poolerCheck.err
}

// directLibPQ reports whether c, a lib/pq connection, reaches the server
// itself: pg_backend_pid() is the PID of the BackendKeyData lib/pq read
// at the connection's start (its unexported field pid, processID before
// v1.11), which a pooler makes up. Not found: false.
func directLibPQ(ctx context.Context, c *sql.Conn) (bool, error) {
	var keyPID int64
	found := false
	_ = c.Raw(func(dc any) error {
		v := reflect.ValueOf(dc)
		for v.Kind() == reflect.Pointer || v.Kind() == reflect.Interface {
			v = v.Elem()
		}
		if v.Kind() != reflect.Struct {
			return nil
		}
		for _, name := range []string{"pid", "processID"} {
			if f := v.FieldByName(name); f.IsValid() && f.CanInt() {
				keyPID, found = f.Int(), true
				return nil
			}
		}
		return nil
	})
	var pid int64
	if err := c.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&pid); err != nil {
		return false, err
	}
	return found && keyPID != 0 && pid == keyPID, nil
}

// binaryParameters reports whether c, a lib/pq connection, sends its
// statements in one round trip (binary_parameters=yes), read from the
// driver's connection: lib/pq keeps it in an unexported field
// (cfg.BinaryParameters from v1.11, binaryParameters before). Not found:
// false.
func binaryParameters(c *sql.Conn) bool {
	var on bool
	_ = c.Raw(func(dc any) error {
		v := reflect.ValueOf(dc)
		for v.Kind() == reflect.Pointer || v.Kind() == reflect.Interface {
			v = v.Elem()
		}
		if v.Kind() != reflect.Struct {
			return nil
		}
		if f := v.FieldByName("cfg"); f.IsValid() && f.Kind() == reflect.Struct {
			if bp := f.FieldByName("BinaryParameters"); bp.IsValid() && bp.Kind() == reflect.Bool {
				on = bp.Bool()
			}
		} else if bp := v.FieldByName("binaryParameters"); bp.IsValid() && bp.Kind() == reflect.Bool {
			on = bp.Bool()
		}
		return nil
	})
	return on
}

// probeTransactionPooling tells whether c's server connection changes
// hands between transactions, as probePooler does: c reads its backend
// PID, a second connection of db reads its own inside a transaction, and c
// reads again.
func probeTransactionPooling(ctx context.Context, c *sql.Conn, db *sql.DB) (bool, error) {
	pid := func(q interface {
		QueryRowContext(context.Context, string, ...any) *sql.Row
	}) (p int64, err error) {
		err = q.QueryRowContext(ctx, "SELECT pg_backend_pid()").Scan(&p)
		return p, err
	}
	first, err := pid(c)
	if err != nil {
		return false, err
	}
	other, err := db.Conn(ctx)
	if err != nil {
		return false, err
	}
	defer other.Close()
	tx, err := other.BeginTx(ctx, nil)
	if err != nil {
		return false, err
	}
	defer tx.Rollback()
	second, err := pid(tx)
	if err != nil {
		return false, err
	}
	again, err := pid(c)
	if err != nil {
		return false, err
	}
	return second == first || again != first, nil
}
