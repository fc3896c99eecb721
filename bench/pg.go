package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/url"
	"sync"
	"sync/atomic"
	"time"

	"cirello.io/pglock"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	_ "github.com/lib/pq" // pglock.New accepts only lib/pq, its "ratified" driver

	"github.com/ashlock/ashlock/dialect/postgres"
	"github.com/ashlock/ashlock/internal/lockbench"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// benchSchema holds every table the benchmark creates; it is dropped and
// re-created at the start and dropped at the end.
const benchSchema = "ashlock_bench"

const (
	rawAcquireSQL = `
INSERT INTO raw_locks AS l (key, token, held, deadline, owner)
VALUES ($1, 1, true, clock_timestamp() + $2::bigint * interval '1 microsecond', $3)
ON CONFLICT (key) DO UPDATE
SET token = l.token + 1, held = true, deadline = excluded.deadline, owner = excluded.owner
WHERE NOT l.held OR l.deadline <= clock_timestamp()
RETURNING l.token`
	rawReleaseSQL = `UPDATE raw_locks SET held = false WHERE key = $1 AND token = $2`

	// rawUpdateAcquireSQL is the plain conditional UPDATE (hot key only:
	// it needs the row to exist).
	rawUpdateAcquireSQL = `
UPDATE raw_locks SET token = token + 1, held = true,
    deadline = clock_timestamp() + $2::bigint * interval '1 microsecond', owner = $3
WHERE key = $1 AND (NOT held OR deadline <= clock_timestamp())
RETURNING token`
)

// countTracer counts the statements a pgx pool sends.
type countTracer struct{ n atomic.Int64 }

func (t *countTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	t.n.Add(1)
	return ctx
}
func (t *countTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// pgEnv is everything the PostgreSQL sections share.
type pgEnv struct {
	url     string // with search_path=benchSchema
	tracer  *countTracer
	pool    *pgxpool.Pool // the shared pool, MaxConns = the largest concurrency
	admin   *pgx.Conn     // for probes; not traced
	adminMu sync.Mutex
	sqlDB   *sql.DB // pgx stdlib, for migrations

	backend, backendNoNotify, backendDurable *postgres.Backend
	client                                   *sqllock.Client

	// The Backend on a *sql.DB (postgres.NewDB): through pgx's stdlib
	// driver (its statements traced like the pool's), and lib/pq with
	// binary_parameters=yes (one round trip per statement; not traced),
	// its statements prepared per connection (the default) or sent
	// unnamed (Options.UnnamedStatements, as behind a pooler).
	sqlPgxDB, sqlPqDB                                *sql.DB
	backendSQLPgx, backendSQLPq, backendSQLPqUnnamed *postgres.Backend

	pglockDB *sql.DB
	pglock   *pglock.Client

	keys []string
	ttl  time.Duration

	keep []func() // closes what a section left holding locks
}

func withParam(raw, k, v string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil {
		return "", err
	}
	q := u.Query()
	q.Set(k, v)
	u.RawQuery = q.Encode()
	return u.String(), nil
}

func (e *pgEnv) newPool(ctx context.Context, maxConns int32, params map[string]string) (*pgxpool.Pool, error) {
	cfg, err := pgxpool.ParseConfig(e.url)
	if err != nil {
		return nil, err
	}
	cfg.MaxConns = maxConns
	cfg.ConnConfig.Tracer = e.tracer
	for k, v := range params {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	return pgxpool.NewWithConfig(ctx, cfg)
}

func setupPG(ctx context.Context, baseURL string, maxConc, nkeys int) (*pgEnv, error) {
	e := &pgEnv{tracer: &countTracer{}, ttl: 30 * time.Second}
	admin, err := pgx.Connect(ctx, baseURL)
	if err != nil {
		return nil, err
	}
	e.admin = admin
	if _, err := admin.Exec(ctx, `DROP SCHEMA IF EXISTS `+benchSchema+` CASCADE`); err != nil {
		return nil, err
	}
	if _, err := admin.Exec(ctx, `CREATE SCHEMA `+benchSchema); err != nil {
		return nil, err
	}
	if e.url, err = withParam(baseURL, "search_path", benchSchema); err != nil {
		return nil, err
	}
	if e.pool, err = e.newPool(ctx, int32(maxConc), nil); err != nil {
		return nil, err
	}
	cc, err := pgx.ParseConfig(e.url)
	if err != nil {
		return nil, err
	}
	e.sqlDB = stdlib.OpenDB(*cc)
	for _, table := range []string{"sqllock_locks", "raw_locks"} {
		if err := migrations.Up(ctx, migrations.Postgres, e.sqlDB, migrations.Options{Schema: benchSchema, Table: table}); err != nil {
			return nil, fmt.Errorf("migrate %s: %w", table, err)
		}
	}
	e.keys = make([]string, nkeys)
	for i := range e.keys {
		e.keys[i] = fmt.Sprintf("k%05d", i)
	}
	// Every key has a released row, as in a system that has run a while.
	for _, table := range []string{"sqllock_locks", "raw_locks"} {
		if _, err := e.pool.Exec(ctx, `INSERT INTO `+table+` (key, token, held, deadline, owner)
			SELECT k, 1, false, clock_timestamp(), '' FROM unnest($1::text[]) AS k`, e.keys); err != nil {
			return nil, err
		}
		if _, err := e.pool.Exec(ctx, `VACUUM ANALYZE `+table); err != nil {
			return nil, err
		}
	}
	if e.backend, err = postgres.New(e.pool, postgres.Options{Schema: benchSchema}); err != nil {
		return nil, err
	}
	if e.backendNoNotify, err = postgres.New(e.pool, postgres.Options{Schema: benchSchema, DisableNotify: true}); err != nil {
		return nil, err
	}
	if e.backendDurable, err = postgres.New(e.pool, postgres.Options{Schema: benchSchema, DurableRelease: true}); err != nil {
		return nil, err
	}
	if e.client, err = sqllock.New(e.backend, sqllock.Options{Owner: "bench"}); err != nil {
		return nil, err
	}
	tc := cc.Copy()
	tc.Tracer = e.tracer
	e.sqlPgxDB = stdlib.OpenDB(*tc)
	pqURL, err := withParam(e.url, "binary_parameters", "yes")
	if err != nil {
		return nil, err
	}
	if e.sqlPqDB, err = sql.Open("postgres", pqURL); err != nil {
		return nil, err
	}
	for _, db := range []*sql.DB{e.sqlPgxDB, e.sqlPqDB} {
		db.SetMaxOpenConns(maxConc + 1) // + the listener's, under pgx
		db.SetMaxIdleConns(maxConc + 1)
	}
	if e.backendSQLPgx, err = postgres.NewDB(e.sqlPgxDB, postgres.Options{Schema: benchSchema}); err != nil {
		return nil, err
	}
	if e.backendSQLPq, err = postgres.NewDB(e.sqlPqDB, postgres.Options{Schema: benchSchema}); err != nil {
		return nil, err
	}
	if e.backendSQLPqUnnamed, err = postgres.NewDB(e.sqlPqDB, postgres.Options{Schema: benchSchema, UnnamedStatements: true}); err != nil {
		return nil, err
	}
	if e.pglockDB, err = sql.Open("postgres", e.url); err != nil {
		return nil, err
	}
	// database/sql keeps 2 idle connections by default, which would make
	// pglock reconnect all the time at high concurrency; its heartbeat
	// goroutine needs a second connection per lock.
	e.pglockDB.SetMaxIdleConns(2 * maxConc)
	e.pglockDB.SetMaxOpenConns(2 * maxConc)
	if e.pglock, err = pglock.New(e.pglockDB, pglock.WithCustomTable("pglock_locks")); err != nil {
		return nil, err
	}
	if err := e.pglock.TryCreateTable(); err != nil {
		return nil, err
	}
	return e, nil
}

func (e *pgEnv) close(ctx context.Context, dropSchema bool) {
	for _, f := range e.keep {
		f()
	}
	if e.backend != nil {
		e.backend.Close()
		e.backendNoNotify.Close()
		e.backendDurable.Close()
	}
	if e.backendSQLPgx != nil {
		e.backendSQLPgx.Close()
		e.backendSQLPq.Close()
	}
	for _, db := range []*sql.DB{e.sqlPgxDB, e.sqlPqDB} {
		if db != nil {
			db.Close()
		}
	}
	if e.pglockDB != nil {
		e.pglockDB.Close()
	}
	if e.sqlDB != nil {
		e.sqlDB.Close()
	}
	if e.pool != nil {
		e.pool.Close()
	}
	if dropSchema {
		if _, err := e.admin.Exec(ctx, `DROP SCHEMA IF EXISTS `+benchSchema+` CASCADE`); err != nil {
			fmt.Printf("bench: drop schema %s: %v\n", benchSchema, err)
		}
	}
	e.admin.Close(ctx)
}

// read implements probe: WAL insert position and next transaction id from
// the admin connection, statements from the tracer.
func (e *pgEnv) read(ctx context.Context) counters {
	e.adminMu.Lock()
	defer e.adminMu.Unlock()
	var c counters
	err := e.admin.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::float8,
		pg_snapshot_xmax(pg_current_snapshot())::text::float8`).Scan(&c.walBytes, &c.xids)
	c.statements = float64(e.tracer.n.Load())
	c.ok = err == nil
	return c
}

func micros(d time.Duration) int64 { return int64(d / time.Microsecond) }

// Throughput contenders. Each pair takes a random key of e.keys.

func (e *pgEnv) rawContender(name, releaseSQL string, releasePool *pgxpool.Pool) contender {
	if releasePool == nil {
		releasePool = e.pool
	}
	return contender{name: name, newWorker: func(id int, rng *rand.Rand) pairFunc {
		owner := fmt.Sprintf("raw-%d", id)
		ttl := micros(e.ttl)
		return func(ctx context.Context) (bool, error) {
			key := e.keys[rng.IntN(len(e.keys))]
			token, err := rawAcquire(ctx, e.pool, key, owner, ttl)
			if err != nil || token == 0 {
				return false, err
			}
			_, err = releasePool.Exec(ctx, releaseSQL, key, token)
			return true, err
		}
	}}
}

// rawAcquire sends the raw upsert for ttl microseconds: the token, or 0
// when the key is held.
func rawAcquire(ctx context.Context, pool *pgxpool.Pool, key, owner string, ttl int64) (int64, error) {
	var token int64
	err := pool.QueryRow(ctx, rawAcquireSQL, key, ttl, owner).Scan(&token)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil
	}
	return token, err
}

func backendContender(name string, b sqllock.Backend, keys []string, ttl time.Duration) contender {
	return contender{name: name, newWorker: func(id int, rng *rand.Rand) pairFunc {
		return lockbench.Pair(b, randomKey(keys, rng), ttl, lockbench.Owner(fmt.Sprintf("bench-%d", id)))
	}}
}

func clientContender(name string, c *sqllock.Client, keys []string) contender {
	return contender{name: name, newWorker: func(id int, rng *rand.Rand) pairFunc {
		return lockbench.ClientPair(c, randomKey(keys, rng))
	}}
}

// randomKey draws a key of keys with rng.
func randomKey(keys []string, rng *rand.Rand) func() string {
	return func() string { return keys[rng.IntN(len(keys))] }
}

func (e *pgEnv) pglockContender() contender {
	return contender{name: "pglock", newWorker: func(id int, rng *rand.Rand) pairFunc {
		return func(ctx context.Context) (bool, error) {
			l, err := e.pglock.AcquireContext(ctx, e.keys[rng.IntN(len(e.keys))], pglock.FailIfLocked())
			if errors.Is(err, pglock.ErrNotAcquired) {
				return false, nil
			}
			if err != nil {
				return false, err
			}
			return true, e.pglock.ReleaseContext(ctx, l)
		}
	}}
}

// advisoryBase keeps the benchmark's advisory lock ids away from anything
// else's.
const advisoryBase = int64(0x5a5a) << 32

func (e *pgEnv) advisoryContender() contender {
	return contender{name: "advisory", newWorker: func(id int, rng *rand.Rand) pairFunc {
		return func(ctx context.Context) (bool, error) {
			k := advisoryBase + int64(rng.IntN(len(e.keys)))
			// Session-level advisory locks belong to a connection: lock and
			// unlock on the same one.
			conn, err := e.pool.Acquire(ctx)
			if err != nil {
				return false, err
			}
			defer conn.Release()
			var ok bool
			if err := conn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1)`, k).Scan(&ok); err != nil || !ok {
				return false, err
			}
			return true, conn.QueryRow(ctx, `SELECT pg_advisory_unlock($1)`, k).Scan(&ok)
		}
	}}
}

// floorContender sends two `SELECT 1` per pair: the round trips of a pair
// without any lock or write, the machine's floor for two statements.
func (e *pgEnv) floorContender() contender {
	return contender{name: "floor", newWorker: func(id int, rng *rand.Rand) pairFunc {
		return func(ctx context.Context) (bool, error) {
			var one int
			if err := e.pool.QueryRow(ctx, `SELECT 1`).Scan(&one); err != nil {
				return false, err
			}
			return true, e.pool.QueryRow(ctx, `SELECT 1`).Scan(&one)
		}
	}}
}

func (e *pgEnv) throughput(cfg *config) *matrix {
	return &matrix{
		section: "pg",
		contenders: []contender{
			e.rawContender("raw", rawReleaseSQL, nil),
			e.rawContender("raw-async", rawReleaseAsyncSQL, nil),
			backendContender("backend", e.backend, e.keys, e.ttl),
			backendContender("backend-durable", e.backendDurable, e.keys, e.ttl),
			backendContender("backend-nonotify", e.backendNoNotify, e.keys, e.ttl),
			backendContender("backend-sqldb-pgx", e.backendSQLPgx, e.keys, e.ttl),
			backendContender("backend-sqldb-pq", e.backendSQLPq, e.keys, e.ttl),
			backendContender("backend-sqldb-pq-unnamed", e.backendSQLPqUnnamed, e.keys, e.ttl),
			clientContender("client", e.client, e.keys),
			e.pglockContender(),
			e.advisoryContender(),
			e.floorContender(),
		},
		conc: cfg.conc, rounds: cfg.rounds, dur: cfg.dur, probe: e, warmup: cfg.warmup(),
		latency: true, statementsPer: true, noStatements: map[string]bool{"pglock": true, "backend-sqldb-pq": true, "backend-sqldb-pq-unnamed": true},
	}
}
