package integration

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/dialect/postgres"
	"github.com/ashlock/ashlock/internal/testkit/faultbackend"
	"github.com/ashlock/ashlock/internal/testkit/faultproxy"
	"github.com/ashlock/ashlock/internal/testkit/history"
	"github.com/ashlock/ashlock/internal/testkit/pgtest"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// The robustness tests against PostgreSQL (TestRobust*: partitions,
// delayed packets, resets, lost replies, stalls, the chaos history). Each client has its own pool, backend and fault wrapper
// (recording only), optionally behind its own faultproxy; a trigger on the
// lock table keeps the database's audit log, from which the checkers of
// internal/testkit/history judge the run.

// robustAuditSQL creates the audit log: every row version the lock table
// commits, with the kind of statement that wrote it, except a waiter's mark.
const robustAuditSQL = `
CREATE TABLE robust_audit (
    seq      bigserial   PRIMARY KEY,
    key      text        NOT NULL,
    token    bigint      NOT NULL,
    held     boolean     NOT NULL,
    deadline timestamptz NOT NULL,
    owner    text        NOT NULL,
    at       timestamptz NOT NULL DEFAULT clock_timestamp(),
    kind     text        NOT NULL
);
CREATE FUNCTION robust_audit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- A waiter's mark (migration 00003: only "waited" changes) is no
    -- lease operation.
    IF TG_OP = 'UPDATE' AND (NEW.token, NEW.held, NEW.deadline, NEW.owner)
            IS NOT DISTINCT FROM (OLD.token, OLD.held, OLD.deadline, OLD.owner) THEN
        RETURN NULL;
    END IF;
    INSERT INTO robust_audit (key, token, held, deadline, owner, kind)
    VALUES (NEW.key, NEW.token, NEW.held, NEW.deadline, NEW.owner,
            CASE WHEN current_query() LIKE '%AS granted%' THEN 'acquire'
                 WHEN current_query() LIKE '%AS renewed%' THEN 'renew'
                 WHEN current_query() LIKE '%AS released%' THEN 'release'
                 ELSE 'other' END);
    RETURN NULL;
END $$;
CREATE TRIGGER robust_audit AFTER INSERT OR UPDATE ON sqllock_locks
    FOR EACH ROW EXECUTE FUNCTION robust_audit();`

// robustWorld is one robustness test's database, recorder and clients.
type robustWorld struct {
	t     *testing.T
	db    *pgtest.DB
	rec   *history.Recorder
	res   *history.Resource
	ttl   time.Duration
	start time.Time
	// beOpts are the clients' Backend options (the zero value unless a
	// test sets them before its first client).
	beOpts postgres.Options

	mu       sync.Mutex // guards clients and watchers
	clients  []*robustClient
	watchers []robustWatcher
	wg       sync.WaitGroup // guard watchers
}

// robustWatcher is the watcher of one guard: recorded is closed once it
// has recorded the guard's end.
type robustWatcher struct {
	g        *sqllock.Guard
	recorded chan struct{}
}

// robustClient is one client: pool, backend, recording wrapper, client, and
// the proxy in front of its connections (nil when direct).
type robustClient struct {
	id    int
	proxy *faultproxy.Proxy
	pool  *pgxpool.Pool
	be    *postgres.Backend
	fdb   *faultbackend.DB
	fb    *faultbackend.Backend
	c     *sqllock.Client
	app   string
	cfg   *pgxpool.Config // the pool's configuration (through the proxy)
}

// extraPool opens another pool on the same route (proxy) as pc's, closed
// at the end of the test.
func (pc *robustClient) extraPool(t *testing.T) *pgxpool.Pool {
	t.Helper()
	cfg := pc.cfg.Copy()
	cfg.MaxConns = 1
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

// migrateUp applies every migration to db's schema.
func migrateUp(ctx context.Context, t *testing.T, db *pgtest.DB) {
	t.Helper()
	sqlDB := stdlib.OpenDBFromPool(db.Pool)
	require.NoError(t, migrations.Up(ctx, migrations.Postgres, sqlDB, migrations.Options{Schema: db.Schema}))
	require.NoError(t, sqlDB.Close())
}

func newRobustWorld(t *testing.T, name string, seed uint64, ttl time.Duration, params history.Params) *robustWorld {
	t.Helper()
	return newRobustWorldOn(t, pgtest.New(t), name, seed, ttl, params)
}

// newRobustWorldOn is newRobustWorld on db, a schema of the shared server or
// of a server of the test's own.
func newRobustWorldOn(t *testing.T, db *pgtest.DB, name string, seed uint64, ttl time.Duration, params history.Params) *robustWorld {
	t.Helper()
	// A guard may be observed ending up to Eps after its local deadline;
	// only with Eps below the margin does C-GUARD still prove that it ended
	// before the database deadline.
	require.Less(t, params.Eps, robustSettings.margin, "the checker's slack must be below the clients' margin")
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	migrateUp(ctx, t, db)
	_, err := db.Pool.Exec(ctx, robustAuditSQL)
	require.NoError(t, err)
	rec := history.NewRecorder(name, seed, params)
	w := &robustWorld{t: t, db: db, rec: rec, res: history.NewResource(rec), ttl: ttl, start: time.Now()}
	t.Cleanup(w.close)
	return w
}

// client starts a client; through a proxy of its own when viaProxy.
func (w *robustWorld) client(viaProxy bool, opts sqllock.Options) *robustClient {
	return w.clientConns(viaProxy, 4, nil, opts)
}

// clientConns is client with a pool of maxConns connections whose
// sessions get the runtime parameters params.
func (w *robustWorld) clientConns(viaProxy bool, maxConns int32, params map[string]string, opts sqllock.Options) *robustClient {
	t := w.t
	t.Helper()
	w.mu.Lock()
	id := len(w.clients)
	w.mu.Unlock()
	cfg, err := pgxpool.ParseConfig(w.db.URL)
	require.NoError(t, err)
	pc := &robustClient{id: id, app: fmt.Sprintf("robust-%d-%d", os.Getpid(), id)}
	if viaProxy {
		target := net.JoinHostPort(cfg.ConnConfig.Host, fmt.Sprint(cfg.ConnConfig.Port))
		pc.proxy, err = faultproxy.New(target)
		require.NoError(t, err)
		host, port, err := net.SplitHostPort(pc.proxy.Addr())
		require.NoError(t, err)
		cfg.ConnConfig.Host = host
		_, err = fmt.Sscan(port, &cfg.ConnConfig.Port)
		require.NoError(t, err)
		cfg.ConnConfig.Fallbacks = nil
	}
	cfg.MaxConns = maxConns
	cfg.ConnConfig.ConnectTimeout = 2 * time.Second
	cfg.ConnConfig.RuntimeParams["application_name"] = pc.app
	for k, v := range params {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	pc.pool, err = pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	pc.cfg = cfg
	pc.be, err = postgres.New(pc.pool, w.beOpts)
	require.NoError(t, err)
	pc.fdb = faultbackend.NewDB(pc.be, faultbackend.DBOptions{Recorder: w.rec})
	pc.fb = pc.fdb.Client(faultbackend.Config{Client: id})
	opts.Owner = fmt.Sprintf("c%d", id)
	opts.TTL = w.ttl
	if opts.Backoff == nil {
		opts.Backoff = robustBackoff
	}
	if opts.ReleaseTimeout == 0 {
		opts.ReleaseTimeout = time.Second
	}
	pc.c, err = sqllock.New(pc.fb, opts)
	require.NoError(t, err)
	w.mu.Lock()
	w.clients = append(w.clients, pc)
	w.mu.Unlock()
	return pc
}

// robustBackoff is the clients' deterministic robustBackoff: 10ms·2^(n-1), capped at
// 80ms, so that a waiter polls at least every 80ms.
func robustBackoff(attempt int) time.Duration {
	return 10 * time.Millisecond << min(max(attempt-1, 0), 3)
}

// close ends every client and checks connection hygiene: no acquired
// pool connection, no session of ours left idle in a transaction.
func (w *robustWorld) close() {
	t := w.t
	w.mu.Lock()
	clients := w.clients
	w.mu.Unlock()
	for _, pc := range clients {
		if pc.proxy != nil {
			pc.proxy.Pass()
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		require.NoError(t, pc.c.Close(ctx))
		cancel()
	}
	w.wg.Wait()
	for _, pc := range clients {
		require.NoError(t, pc.be.Close())
		if pc.proxy != nil {
			// A connection whose bytes a blackhole dropped hangs until
			// pgx gives up on its cancel request (15s); reset it, as a
			// middlebox would after the partition.
			pc.proxy.Reset()
		}
		// pgxpool destroys a connection broken in flight in the
		// background: poll.
		robustEventually(t, 5*time.Second, func() bool { return pc.pool.Stat().AcquiredConns() == 0 },
			"client %d: pool connections still acquired", pc.id)
		pc.pool.Close()
		if pc.proxy != nil {
			require.NoError(t, pc.proxy.Close())
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var idle int
	require.NoError(t, w.db.Pool.QueryRow(ctx,
		`SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE $1 AND state LIKE 'idle in transaction%'`,
		fmt.Sprintf("robust-%d-%%", os.Getpid())).Scan(&idle))
	require.Zero(t, idle, "sessions left idle in a transaction")
}

// hold acquires key for pc (waiting up to wait) and records the wait and
// the guard, whose end a watcher records.
func (w *robustWorld) hold(ctx context.Context, pc *robustClient, key string, wait time.Duration, try bool) (*sqllock.Guard, int, error) {
	start := w.rec.Now()
	var g *sqllock.Guard
	var err error
	if try {
		g, err = pc.c.TryAcquire(ctx, key, nil)
	} else {
		g, err = pc.c.Acquire(ctx, key, &sqllock.AcquireOptions{Wait: wait})
	}
	wt := history.Wait{Client: pc.id, Key: key, Start: start, End: w.rec.Now()}
	if err != nil {
		wt.Err = err.Error()
		w.rec.Wait(wt)
		return nil, 0, err
	}
	wt.Token = g.Token()
	w.rec.Wait(wt)
	s := pc.settings()
	gid := w.rec.GuardStart(history.Guard{Client: pc.id, Key: key, Owner: g.Lease().Owner, Token: g.Token(),
		TTL: w.ttl, Margin: s.margin, Interval: s.interval, Start: w.rec.Now()})
	gw := robustWatcher{g: g, recorded: make(chan struct{})}
	w.mu.Lock()
	w.watchers = append(w.watchers, gw)
	w.mu.Unlock()
	w.wg.Add(1)
	go func() {
		defer w.wg.Done()
		defer close(gw.recorded)
		<-g.Done()
		end := w.rec.Now()
		cause := context.Cause(g.Context())
		var le *sqllock.LostError
		c := fmt.Sprint(cause)
		if errors.As(cause, &le) {
			c = "lost: " + le.Reason.String()
		}
		ld := w.rec.Local(g.LocalDeadline())
		w.rec.GuardUpdate(gid, func(hg *history.Guard) { hg.End, hg.Cause, hg.LocalDeadline = end, c, ld })
	}()
	return g, gid, nil
}

type robustClientSettings struct{ margin, interval time.Duration }

// settings are the timings every client of these tests uses (see opts).
func (pc *robustClient) settings() robustClientSettings { return robustSettings }

// robustTTL is the lease TTL of the robustness tests' worlds. With the
// margin of robustSettings, a guard's local deadline is 2.8s after the send
// of its last successful renewal, 1.2s before the database deadline. The
// end of a guard is observed by a watcher goroutine, so on a loaded CI
// machine (2 cores, several test binaries, -race) it includes that
// goroutine's scheduling delay: the checks allow robustParams.Eps and
// cancelSlack (800ms) for it, which the margin exceeds by 400ms, so that a
// guard observed ending within the slack still ended before the database
// deadline.
const robustTTL = 4 * time.Second

var robustSettings = robustClientSettings{margin: 1200 * time.Millisecond, interval: 500 * time.Millisecond}

// opts are the client options of these tests: TTL the world's (robustTTL
// unless a test says otherwise), renew every 500ms, margin 1.2s.
func robustOpts() sqllock.Options {
	return sqllock.Options{RenewInterval: robustSettings.interval, Margin: robustSettings.margin}
}

// rmw is one fenced read-modify-write of the counter of key, as the holder
// of g (guard gid) does it. A careless holder does not look at its guard
// between its read and its write: if the guard ended meanwhile, its write
// is a zombie's (the paused-holder case), and the guard's belief is
// extended to it.
func (w *robustWorld) rmw(pc *robustClient, g *sqllock.Guard, gid int, key string, work time.Duration, careless bool) bool {
	acc := func() history.Access {
		valid := g.Err() == nil
		return history.Access{Client: pc.id, Guard: gid, GuardValid: valid, Zombie: !valid}
	}
	if g.Err() != nil {
		return false
	}
	v, ok := w.res.Read(key, g.Token(), acc())
	if !ok {
		return false
	}
	if work > 0 {
		t := time.NewTimer(work) // the holder's work, not a wait for a condition
		select {
		case <-t.C:
		case <-g.Done():
			t.Stop()
			if !careless {
				return false
			}
		}
	}
	if !careless && g.Err() != nil {
		return false
	}
	a := acc()
	ok = w.res.Write(key, g.Token(), v+1, a)
	if a.Zombie {
		now := w.rec.Now()
		w.rec.GuardUpdate(gid, func(hg *history.Guard) { hg.Zombie, hg.BeliefEnd = true, max(hg.BeliefEnd, now) })
	}
	return ok
}

// readAudit reads the audit log into the history: database times become
// local times by the wall clock (same host), and a grant's or renewal's
// database time is its deadline minus the TTL, exactly the statement's.
func (w *robustWorld) readAudit(ctx context.Context) {
	t := w.t
	rows, err := w.db.Pool.Query(ctx, `SELECT seq, key, token, held, deadline, owner, at, kind FROM robust_audit ORDER BY seq`)
	require.NoError(t, err)
	defer rows.Close()
	base := w.rec.WallBase()
	micros := (w.ttl + time.Microsecond - 1) / time.Microsecond * time.Microsecond
	var as []history.Audit
	for rows.Next() {
		var (
			a        history.Audit
			held     bool
			deadline time.Time
			at       time.Time
			kind     string
		)
		require.NoError(t, rows.Scan(&a.Seq, &a.Key, &a.Token, &held, &deadline, &a.Owner, &at, &kind))
		a.Outcome, a.Deadline, a.DBNow = history.OK, deadline.UnixNano(), at.UnixNano()
		switch kind {
		case "acquire":
			a.Kind, a.TTL = history.Acquire, w.ttl
			a.DBNow = a.Deadline - int64(micros)
		case "renew":
			a.Kind, a.TTL = history.Renew, w.ttl
			a.DBNow = a.Deadline - int64(micros)
		case "release":
			// The row does not say whether the lease was still valid
			// (ok) or had expired (lost, cleared all the same), and the
			// trigger's time is not the statement's: leave the database
			// time unknown to the model.
			a.Kind, a.Deadline = history.Release, 0
		default:
			a.Kind, a.Deadline = history.Expire, deadline.UnixNano()
			a.DBNow = deadline.UnixNano()
		}
		a.At = a.DBNow - base
		if a.Kind == history.Release {
			a.At, a.DBNow = at.UnixNano()-base, 0
		}
		as = append(as, a)
	}
	require.NoError(t, rows.Err())
	w.rec.AddAudit(as...)
}

// robustLinkSlack is LinkAudit's slack between the database's wall-clock
// times and the recorder's monotonic times: it absorbs the drift of the
// wall clock (NTP slewing, up to 0.5ms/s) over a run of a minute or more.
// It only widens the time window in which a release record is matched to
// a definite release of the same lease, and in which an unmatched record is
// given to an unknown call of the same owner or lease.
const robustLinkSlack = 50 * time.Millisecond

// check reads the audit log, links it to the calls and runs every checker
// and porcupine. On failure it writes the artifacts and fails t. Every
// guard must have ended (a guard still held is reported as never ended).
func (w *robustWorld) check(ctx context.Context, replay string) (*history.History, *history.Report) {
	t := w.t
	t.Helper()
	w.awaitEnded()
	w.readAudit(ctx)
	w.res.Finish()
	h := w.rec.History()
	left := history.LinkAudit(h, robustLinkSlack)
	r := history.Check(h)
	model, info := history.CheckLin(h, r, true, 60*time.Second)
	if left > 0 {
		r.Violations = append(r.Violations, history.Violation{Checker: "recorder", Msg: fmt.Sprintf("%d audit records match no call", left)})
	}
	if r.Anomalies() > 0 {
		dir := history.ArtifactDir(t, "history")
		if err := history.WriteArtifacts(dir, h, r, &model, &info, replay); err != nil {
			t.Logf("artifacts: %v", err)
		}
		t.Errorf("%d anomalies (%s); first: %s\nreplay: %s\nartifacts: %s", r.Anomalies(), r.Checkers(), r.First(), replay, dir)
	}
	return h, r
}

var _ = porcupine.Ok

// awaitEnded waits until the watcher of every guard that has ended has
// recorded its end, so that a guard released just before check is not
// seen as never ended. A guard still held keeps its watcher running: it is
// not waited for (its end stays open in the history).
func (w *robustWorld) awaitEnded() {
	w.mu.Lock()
	ws := append([]robustWatcher(nil), w.watchers...)
	w.mu.Unlock()
	for _, gw := range ws {
		select {
		case <-gw.g.Done():
			<-gw.recorded // the watcher is past <-g.Done(): it records and returns
		default:
		}
	}
}

// figures renders the test's figure line.
func (w *robustWorld) figures(test string, h *history.History, r *history.Report, faults map[string]int, extra ...string) string {
	ops := map[string]map[history.Outcome]int{}
	for _, op := range h.Ops {
		if ops[string(op.Kind)] == nil {
			ops[string(op.Kind)] = map[history.Outcome]int{}
		}
		ops[string(op.Kind)][op.Outcome]++
	}
	var parts []string
	for _, k := range []string{"acquire", "renew", "release"} {
		var os []string
		n := 0
		for o, c := range ops[k] {
			os = append(os, fmt.Sprintf("%s:%d", o, c))
			n += c
		}
		sort.Strings(os)
		parts = append(parts, fmt.Sprintf("%s=%d{%s}", k, n, strings.Join(os, " ")))
	}
	var fs []string
	for k, v := range faults {
		fs = append(fs, fmt.Sprintf("%s:%d", k, v))
	}
	sort.Strings(fs)
	s := fmt.Sprintf("RESULT test=%s backend=postgres ops: %s faults={%s} stale_writes={attempted:%d, rejected:%d, applied:%d} zombie_writes={attempted:%d, rejected:%d} accepted_writes=%d lin={%s, ops:%d, time:%v} token_regressions=%d db_overlaps=%d guard_violations=%d fence_violations=%d lost_updates=%d paused_overlaps=%d anomalies=%d wall=%v",
		test, strings.Join(parts, " "), strings.Join(fs, ", "),
		r.StaleAttempted, r.StaleRejected, r.StaleApplied, r.ZombieWrites, r.ZombieRejected, r.AcceptedWrites,
		r.Lin, r.LinOps, r.LinTime.Round(time.Millisecond),
		r.Count(history.CToken), r.Count(history.CDBOverlap), r.Count(history.CGuard), r.Count(history.CFence), r.Count(history.CLostUpdate),
		r.PausedOverlaps, r.Anomalies(), time.Since(w.start).Round(time.Millisecond))
	for _, e := range extra {
		s += " " + e
	}
	return s
}

// requireFired fails t for each configured fault kind injected 0 times.
func robustRequireFired(t *testing.T, faults map[string]int) {
	t.Helper()
	for k, v := range faults {
		require.Positive(t, v, "fault kind %s was configured but injected 0 times", k)
	}
}

// eventually polls cond every 10ms until it holds or d passes.
func robustEventually(t *testing.T, d time.Duration, cond func() bool, msg string, args ...any) {
	t.Helper()
	require.Eventually(t, cond, d, 10*time.Millisecond, append([]any{msg}, args...)...)
}
