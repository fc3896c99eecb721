package integration

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/dialect/postgres"
	"github.com/ashlock/ashlock/internal/testkit/pgtest"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// Server restarts and crashes while a lease is held and a waiter waits
// (issue "PostgreSQL backend" item 4). Each test has its own
// durable server (fsync and synchronous_commit on), so a crash loses nothing
// that was committed, as on a production server.

// restartAuditSQL logs every row version of the lock table, committed in the
// same transaction as the row itself: after a crash it shows exactly what
// the database had committed (grants and renewals with their deadlines).
const restartAuditSQL = `
CREATE TABLE restart_audit (
    seq      bigserial   PRIMARY KEY,
    key      text        NOT NULL,
    token    bigint      NOT NULL,
    held     boolean     NOT NULL,
    deadline timestamptz NOT NULL,
    owner    text        NOT NULL,
    at       timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE FUNCTION restart_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO restart_audit (key, token, held, deadline, owner)
    VALUES (NEW.key, NEW.token, NEW.held, NEW.deadline, NEW.owner);
    RETURN NULL;
END $$;
CREATE TRIGGER restart_audit AFTER INSERT OR UPDATE ON sqllock_locks
    FOR EACH ROW EXECUTE FUNCTION restart_audit();`

// restartServer starts a dedicated durable server, migrates it, installs
// the audit trigger, and returns it with a pool for the test's own queries.
func restartServer(t *testing.T) (*pgtest.Server, *pgxpool.Pool) {
	t.Helper()
	srv := pgtest.NewServer(t, pgtest.ServerOptions{Durable: true})
	admin := restartPool(t, srv.URL, "restart-admin", 2)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	sqlDB := stdlib.OpenDBFromPool(admin)
	require.NoError(t, migrations.Up(ctx, migrations.Postgres, sqlDB, migrations.Options{}))
	require.NoError(t, sqlDB.Close())
	_, err := admin.Exec(ctx, restartAuditSQL)
	require.NoError(t, err)
	var persistence string
	require.NoError(t, admin.QueryRow(ctx, "SELECT relpersistence::text FROM pg_class WHERE oid = 'sqllock_locks'::regclass").Scan(&persistence))
	require.Equal(t, "p", persistence, "the lock table must be logged, or a crash empties it")
	return srv, admin
}

// restartPool opens a pool on url that notices a dead server quickly: a
// short connect timeout, and broken connections are dropped on first use.
// It is closed at the end of the test (before the server is stopped).
func restartPool(t *testing.T, url, app string, maxConns int32) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.MaxConns = maxConns
	cfg.ConnConfig.ConnectTimeout = time.Second
	cfg.HealthCheckPeriod = 500 * time.Millisecond
	cfg.ConnConfig.RuntimeParams["application_name"] = app
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// restartBackend counts renewals by outcome, and records acquire attempts
// refused because the key was held.
type restartBackend struct {
	*postgres.Backend
	renewOK, renewFailed atomic.Int64

	mu        sync.Mutex
	lastErr   error
	refusedAt []time.Time
	refusedBy []int64 // the holder's token
}

func (b *restartBackend) TryRenew(ctx context.Context, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
	nl, err := b.Backend.TryRenew(ctx, l, ttl)
	if err != nil {
		b.renewFailed.Add(1)
		b.mu.Lock()
		b.lastErr = err
		b.mu.Unlock()
	} else {
		b.renewOK.Add(1)
	}
	return nl, err
}

// TryRenewBatch counts each lease of a batch as TryRenew counts one (the
// Client renews through it: the embedded Backend's would be promoted).
func (b *restartBackend) TryRenewBatch(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
	res, err := b.Backend.TryRenewBatch(ctx, reqs)
	for i := range reqs {
		e := err
		if e == nil {
			e = res[i].Err
		}
		if e != nil {
			b.renewFailed.Add(1)
			b.mu.Lock()
			b.lastErr = e
			b.mu.Unlock()
		} else {
			b.renewOK.Add(1)
		}
	}
	return res, err
}

func (b *restartBackend) TryAcquire(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	l, err := b.Backend.TryAcquire(ctx, req)
	if he, ok := errors.AsType[*sqllock.HeldError](err); ok {
		b.mu.Lock()
		b.refusedAt = append(b.refusedAt, time.Now())
		b.refusedBy = append(b.refusedBy, he.Token)
		b.mu.Unlock()
	}
	return l, err
}

// refusals returns how many acquire attempts after t were refused because
// token held the key.
func (b *restartBackend) refusals(after time.Time, token int64) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := 0
	for i, at := range b.refusedAt {
		if at.After(after) && b.refusedBy[i] == token {
			n++
		}
	}
	return n
}

func (b *restartBackend) last() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.lastErr
}

// restartClient is a Client over its own pool and backend.
type restartClient struct {
	pool *pgxpool.Pool
	be   *restartBackend
	c    *sqllock.Client
}

func newRestartClient(t *testing.T, srv *pgtest.Server, name string, opts sqllock.Options) *restartClient {
	t.Helper()
	rc := &restartClient{pool: restartPool(t, srv.URL, "restart-"+name, 4)}
	be, err := postgres.New(rc.pool, postgres.Options{})
	require.NoError(t, err)
	rc.be = &restartBackend{Backend: be}
	opts.Owner = name
	rc.c, err = sqllock.New(rc.be, opts)
	require.NoError(t, err)
	// Runs before the pool's cleanup (last in, first out).
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = rc.c.Close(ctx) // a lost lease's release may fail; the lease ends at its deadline
		require.NoError(t, rc.be.Close())
	})
	return rc
}

// restartResult is the outcome of a waiting Acquire.
type restartResult struct {
	g   *sqllock.Guard
	err error
	at  time.Time
}

// restartWaiter starts rc.Acquire(key) in the background and returns once
// its notification listener is LISTENing, which proves the wait began.
func restartWaiter(ctx context.Context, t *testing.T, admin *pgxpool.Pool, rc *restartClient, key string, wait time.Duration) <-chan restartResult {
	t.Helper()
	ch := make(chan restartResult, 1)
	go func() {
		g, err := rc.c.Acquire(ctx, key, &sqllock.AcquireOptions{Wait: wait})
		ch <- restartResult{g, err, time.Now()}
	}()
	app := "restart-" + rc.c.Owner()
	robustEventually(t, 10*time.Second, func() bool {
		var n int
		err := admin.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE application_name = $1 AND query LIKE 'LISTEN %'`, app).Scan(&n)
		return err == nil && n == 1
	}, "the waiter %s never listened", app)
	return ch
}

// restartPoll waits until cond holds or d passes, polling every 10ms.
func restartPoll(d time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(d)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(10 * time.Millisecond) // a poll interval, not a wait for the condition
	}
	return true
}

// restartTokens returns, per key, the highest token the database has
// committed (from the audit log, which also keeps the tokens of rows that
// a later grant overwrote).
func restartTokens(ctx context.Context, t *testing.T, admin *pgxpool.Pool) map[string]int64 {
	t.Helper()
	rows, err := admin.Query(ctx, "SELECT key, max(token) FROM restart_audit GROUP BY key")
	require.NoError(t, err)
	out := map[string]int64{}
	var key string
	var token int64
	_, err = pgx.ForEachRow(rows, []any{&key, &token}, func() error { out[key] = token; return nil })
	require.NoError(t, err)
	return out
}

// restartLogTable logs the lock table and the audit log.
func restartLogTable(ctx context.Context, t *testing.T, admin *pgxpool.Pool) {
	t.Helper()
	var b strings.Builder
	rows, err := admin.Query(ctx, "SELECT key, token, held, deadline, owner FROM sqllock_locks ORDER BY key")
	require.NoError(t, err)
	var (
		key, owner string
		token      int64
		held       bool
		deadline   time.Time
	)
	b.WriteString("sqllock_locks (logged):")
	_, err = pgx.ForEachRow(rows, []any{&key, &token, &held, &deadline, &owner}, func() error {
		fmt.Fprintf(&b, "\n\tkey=%s token=%d held=%v deadline=%s owner=%s", key, token, held, deadline.Format("15:04:05.000"), owner)
		return nil
	})
	require.NoError(t, err)
	var at time.Time
	rows, err = admin.Query(ctx, "SELECT key, token, held, deadline, owner, at FROM restart_audit ORDER BY seq")
	require.NoError(t, err)
	b.WriteString("\nrestart_audit (every committed row version):")
	_, err = pgx.ForEachRow(rows, []any{&key, &token, &held, &deadline, &owner, &at}, func() error {
		fmt.Fprintf(&b, "\n\tat=%s key=%s token=%d held=%v deadline=%s owner=%s",
			at.Format("15:04:05.000"), key, token, held, deadline.Format("15:04:05.000"), owner)
		return nil
	})
	require.NoError(t, err)
	t.Log(b.String())
}

// TestPostgresRestartFastNoFalseLoss restarts the server (fast shutdown)
// while a holder renews and a waiter waits, and brings it back well before
// the holder's local deadline. Renewals fail while the server is down (at
// least one does: the restart waits for it) and succeed again once it is
// back, on new connections: the guard is not lost, the waiter does not get
// the key while the holder holds it, and gets it with the next token once
// the holder releases.
func TestPostgresRestartFastNoFalseLoss(t *testing.T) {
	t.Parallel()
	const (
		key = "restart"
		// Renew every 2 s, as with the former TTL of 6 s, so the test takes
		// no longer. The server must be back a second before the local
		// deadline: within ≈ 8.9 s of the renewal that fails while it is
		// down (TTL - interval - the default margin of 122 ms - 1 s). A
		// TTL of 6 s left ≈ 2.9 s for the start, too little on a loaded CI
		// machine.
		ttl      = 12 * time.Second
		interval = 2 * time.Second
	)
	srv, admin := restartServer(t)
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	holder := newRestartClient(t, srv, "holder", sqllock.Options{TTL: ttl, RenewInterval: interval})
	waiter := newRestartClient(t, srv, "waiter", sqllock.Options{TTL: ttl})

	g, err := holder.c.TryAcquire(ctx, key, nil)
	require.NoError(t, err)
	waiting := restartWaiter(ctx, t, admin, waiter, key, 40*time.Second)

	// Stop right after a renewal: the most room before the local deadline.
	require.True(t, restartPoll(ttl, func() bool { return holder.be.renewOK.Load() >= 1 }), "no renewal before the restart")
	okBefore, failedBefore := holder.be.renewOK.Load(), holder.be.renewFailed.Load()
	local := g.LocalDeadline()
	stopped := time.Now()
	require.NoError(t, srv.Stop(pgtest.StopFast))
	// Stay down until the watchdog has seen a renewal fail.
	require.True(t, restartPoll(ttl, func() bool { return holder.be.renewFailed.Load() > failedBefore }),
		"no renewal was attempted while the server was down")
	require.NoError(t, srv.Start())
	up := time.Now()
	require.True(t, up.Before(local.Add(-time.Second)),
		"the restart took %v and ended %v before the local deadline: too slow to test a restart within the lease", up.Sub(stopped), local.Sub(up))

	// A renewal succeeds on a new connection, before the local deadline.
	require.True(t, restartPoll(time.Until(local)+time.Second, func() bool {
		return holder.be.renewOK.Load() > okBefore || g.Err() != nil
	}), "no renewal succeeded after the restart")
	renewed := time.Now()
	require.NoError(t, g.Err(), "false loss: the server was back %v before the local deadline (renewal error: %v)", local.Sub(up), holder.be.last())
	require.True(t, g.LocalDeadline().After(local), "the renewal moved the local deadline")
	select {
	case r := <-waiting:
		t.Fatalf("the waiter got the key while the holder held it: %+v", r)
	default:
	}
	var held bool
	var token int64
	require.NoError(t, admin.QueryRow(ctx, "SELECT held AND deadline > clock_timestamp(), token FROM sqllock_locks WHERE key = $1", key).Scan(&held, &token))
	require.True(t, held)
	require.Equal(t, g.Token(), token)

	released := time.Now()
	require.NoError(t, g.Release(ctx))
	var r restartResult
	select {
	case r = <-waiting:
	case <-time.After(10 * time.Second):
		t.Fatal("the waiter did not get the key within 10s of the release")
	}
	require.NoError(t, r.err)
	require.Equal(t, g.Token()+1, r.g.Token(), "the waiter's token follows the holder's")
	require.NoError(t, r.g.Release(ctx))
	// In the database too: the waiter's grant was committed after the
	// holder's last row version (its release), never in between.
	var holderLast, waiterFirst int64
	require.NoError(t, admin.QueryRow(ctx, `SELECT max(seq) FILTER (WHERE token = $2), min(seq) FILTER (WHERE token > $2)
		FROM restart_audit WHERE key = $1`, key, g.Token()).Scan(&holderLast, &waiterFirst))
	require.Less(t, holderLast, waiterFirst, "a newer token was granted while the holder held the key")
	restartLogTable(ctx, t, admin)
	t.Logf("fast restart: down %v (stop to ready), back %v before the local deadline; renewals ok=%d failed=%d (last error: %v); "+
		"renewed %v after Start returned; guard lost=false; waiter got token %d (holder %d) %v after the release",
		up.Sub(stopped).Round(time.Millisecond), local.Sub(up).Round(time.Millisecond), holder.be.renewOK.Load(), holder.be.renewFailed.Load(),
		holder.be.last(), renewed.Sub(up).Round(time.Millisecond), r.g.Token(), g.Token(), r.at.Sub(released).Round(time.Millisecond))
}

// TestPostgresCrashHolderLost crashes the server (immediate stop: no
// checkpoint, crash recovery on the next start) while a lease is held and a
// waiter waits, and keeps it down past the holder's local deadline.
//
//   - G3: the holder's guard is cancelled with a LostError (unreachable) no
//     later than its local deadline (+ scheduling slack, 1 s: the loss is
//     observed by a goroutine, on a loaded machine), which is before the
//     lease's deadline in the database (same host, same wall clock): the
//     local deadline is the send time of the last successful request plus
//     TTL minus the margin, the database deadline that request's database
//     time (after the send) plus TTL, so the margin of 1.5 s keeps local +
//     slack at least 0.5 s before it; the test checks that directly too.
//   - G1 across recovery: the waiter gets the key only once the database
//     clock has passed the old lease's last committed deadline. The holder's
//     margin is 1.5 s, so that the local deadline comes 1.5 s before the
//     database deadline and the server, started at the loss, is usually back
//     while the old lease is still valid in the database: the waiter's
//     attempts are then refused until the deadline (the figures say how
//     many), not merely made after it.
//   - G2 across recovery: every token granted after the crash is greater
//     than every token committed before it, for the held key and for a key
//     that was free.
func TestPostgresCrashHolderLost(t *testing.T) {
	t.Parallel()
	const (
		key, other = "crash", "crash-other"
		ttl        = 4 * time.Second
		margin     = 1500 * time.Millisecond // < TTL/2
		slack      = time.Second             // scheduling of the expiry timer and of this test's observer; < margin
	)
	srv, admin := restartServer(t)
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	holder := newRestartClient(t, srv, "holder", sqllock.Options{TTL: ttl, Margin: margin})
	waiter := newRestartClient(t, srv, "waiter", sqllock.Options{TTL: ttl})

	// Some history: both keys granted and released a few times.
	for range 3 {
		for _, k := range []string{key, other} {
			g, err := holder.c.TryAcquire(ctx, k, nil)
			require.NoError(t, err)
			require.NoError(t, g.Release(ctx))
		}
	}
	g, err := holder.c.TryAcquire(ctx, key, nil)
	require.NoError(t, err)
	lost := make(chan time.Time, 1)
	go func() {
		<-g.Done()
		lost <- time.Now()
	}()
	waiting := restartWaiter(ctx, t, admin, waiter, key, 40*time.Second)
	require.True(t, restartPoll(ttl, func() bool { return holder.be.renewOK.Load() >= 1 }), "no renewal before the crash")
	before := restartTokens(ctx, t, admin)
	require.Equal(t, g.Token(), before[key])
	require.Positive(t, before[other])

	crashed := time.Now()
	require.NoError(t, srv.Stop(pgtest.StopImmediate))
	var lostAt time.Time
	select {
	case lostAt = <-lost:
	case <-time.After(ttl + 5*time.Second):
		t.Fatalf("the guard was not cancelled within %v of the crash (local deadline in %v)", ttl+5*time.Second, time.Until(g.LocalDeadline()))
	}
	local := g.LocalDeadline() // final: a lost guard's deadline no longer moves
	var le *sqllock.LostError
	require.ErrorAs(t, context.Cause(g.Context()), &le)
	require.ErrorIs(t, g.Err(), sqllock.ErrLeaseLost)
	require.Equal(t, sqllock.LostUnreachable, le.Reason, "lost: %v", le)
	require.Equal(t, g.Token(), le.Token)
	require.False(t, lostAt.After(local.Add(slack)), "G3: cancelled %v after the local deadline", lostAt.Sub(local))
	require.False(t, lostAt.Before(local), "cancelled %v before the local deadline, with the lease possibly valid", local.Sub(lostAt))

	// Down past the local deadline (the guard is lost); start again.
	require.NoError(t, srv.Start())
	up := time.Now()

	var r restartResult
	select {
	case r = <-waiting:
	case <-time.After(15 * time.Second):
		t.Fatal("the waiter did not get the key within 15s of the restart")
	}
	require.NoError(t, r.err)
	defer func() { require.NoError(t, r.g.Release(ctx)) }()

	// The old lease's last committed deadline, by the database clock; the
	// crash may have cut off a renewal whose commit the holder never saw.
	var oldDeadline time.Time
	require.NoError(t, admin.QueryRow(ctx, "SELECT max(deadline) FROM restart_audit WHERE key = $1 AND token = $2", key, g.Token()).Scan(&oldDeadline))
	require.False(t, oldDeadline.Before(g.Lease().Deadline), "the audit lost a committed renewal")
	require.True(t, lostAt.Before(oldDeadline), "the loss was reported %v after the lease's database deadline", lostAt.Sub(oldDeadline))
	require.True(t, local.Before(oldDeadline), "the local deadline is after the database deadline")
	wl := r.g.Lease()
	require.False(t, wl.BackendTime.Before(oldDeadline), "G1: the waiter got the key %v before the old lease's database deadline",
		oldDeadline.Sub(wl.BackendTime))
	require.Greater(t, r.g.Token(), before[key], "G2: token after the crash not greater than before")

	// A key that was free at the crash continues above its history too.
	// (Acquire, not TryAcquire: the holder's pool may still hand out a
	// connection that died in the crash; Acquire retries that.)
	g2, err := holder.c.Acquire(ctx, other, &sqllock.AcquireOptions{Wait: 10 * time.Second})
	require.NoError(t, err)
	require.Greater(t, g2.Token(), before[other], "G2: token after the crash not greater than before")
	require.NoError(t, g2.Release(ctx))

	// The lost holder's Release reports the loss.
	require.ErrorIs(t, g.Release(ctx), sqllock.ErrLeaseLost)

	after := restartTokens(ctx, t, admin)
	restartLogTable(ctx, t, admin)
	t.Logf("crash: guard cancelled %v after its local deadline and %v before the database deadline (reason %s, last error: %v); "+
		"server down %v, back %v before the old database deadline; waiter refused %d times after the restart by the old lease, "+
		"got token %d at database time %v after the old deadline, %v after the restart; tokens before crash %v, after %v",
		lostAt.Sub(local).Round(time.Millisecond), oldDeadline.Sub(lostAt).Round(time.Millisecond), le.Reason, le.Err,
		up.Sub(crashed).Round(time.Millisecond), oldDeadline.Sub(up).Round(time.Millisecond), waiter.be.refusals(up, g.Token()),
		r.g.Token(), wl.BackendTime.Sub(oldDeadline).Round(time.Millisecond), r.at.Sub(up).Round(time.Millisecond), before, after)
}
