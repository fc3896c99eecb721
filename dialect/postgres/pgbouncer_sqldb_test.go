package postgres

import (
	"database/sql"
	"fmt"
	"net/url"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/pgtest"
	"github.com/ashlock/ashlock/sqllock"
	"github.com/ashlock/ashlock/sqllock/backendtest"
)

// The Backend on a *sql.DB through PgBouncer, with the settings
// docs/pgbouncer.md documents for each driver: in transaction mode, pgx's
// stdlib driver with default_query_exec_mode=exec and lib/pq with
// binary_parameters=yes (its one-round-trip form: without it lib/pq
// prepares an unnamed statement in one transaction of the pooler's and
// binds it in another), both with DisableNotify; in session mode the
// defaults.

// bouncerDB opens a *sql.DB through bouncer with driver ("pgx" or "pq")
// and the URL's params added, closed in t.Cleanup.
func bouncerDB(t *testing.T, bouncer *pgtest.Bouncer, driver string, params map[string]string) *sql.DB {
	t.Helper()
	u, err := url.Parse(bouncer.URL)
	require.NoError(t, err)
	q := u.Query()
	for k, v := range params {
		q.Set(k, v)
	}
	u.RawQuery = q.Encode()
	var db *sql.DB
	if driver == "pgx" {
		cfg, err := pgx.ParseConfig(u.String())
		require.NoError(t, err)
		db = stdlib.OpenDB(*cfg)
	} else {
		db, err = sql.Open("postgres", u.String())
		require.NoError(t, err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// bouncerDBBackend is a Backend from NewDB on a fresh schema through
// bouncer; the tests' own statements go to the server directly.
func bouncerDBBackend(t *testing.T, bouncer *pgtest.Bouncer, driver string, params map[string]string, opts Options) *Backend {
	t.Helper()
	opts.Schema = bouncerSchema(t, bouncer)
	b, err := NewDB(bouncerDB(t, bouncer, driver, params), opts)
	require.NoError(t, err)
	admin, err := pgxpool.New(testCtx(t), bouncer.DirectURL)
	require.NoError(t, err)
	adminPools.Store(b, admin)
	t.Cleanup(func() {
		require.NoError(t, b.Close())
		adminPools.Delete(b)
		admin.Close()
	})
	return b
}

// transactionParams are the documented settings for transaction mode.
var transactionParams = map[string]map[string]string{
	"pgx": {"default_query_exec_mode": "exec"},
	"pq":  {"binary_parameters": "yes"},
}

func TestDBConformancePgBouncer(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{pgtest.PoolTransaction, pgtest.PoolSession} {
		bouncerMode := mode
		t.Run(bouncerMode, func(t *testing.T) {
			t.Parallel()
			bouncer := pgtest.NewPgBouncer(t, bouncerMode, nil)
			for _, d := range sqlDrivers {
				t.Run(d.name, func(t *testing.T) {
					t.Parallel()
					var mayskip []string
					params, opts := map[string]string(nil), Options{}
					if bouncerMode == pgtest.PoolTransaction {
						params, opts.DisableNotify = transactionParams[d.name], true
					}
					if opts.DisableNotify || d.name != "pgx" {
						mayskip = watchRules
					}
					backendtest.Run(t, harness(func(t *testing.T) sqllock.Backend {
						return asClient(bouncerDBBackend(t, bouncer, d.name, params, opts))
					}, mayskip...))
				})
			}
		})
	}
}

// Through PgBouncer in transaction mode, pgx's stdlib driver with its
// default exec mode and LISTEN is refused at the first statement with
// ErrPoolerSettings, as the pgx pool is, and nothing is applied.
func TestDBPgBouncerMisconfigurationDetected(t *testing.T) {
	t.Parallel()
	bouncer := pgtest.NewPgBouncer(t, pgtest.PoolTransaction, nil)
	b := bouncerDBBackend(t, bouncer, "pgx", nil, Options{})
	ctx := testCtx(t)
	_, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o"})
	t.Log(err)
	require.ErrorIs(t, err, ErrPoolerSettings)
	require.Contains(t, err.Error(), "default_query_exec_mode=exec")
	require.Contains(t, err.Error(), "DisableNotify")
	require.NotErrorIs(t, err, sqllock.ErrIndeterminate, "nothing was sent")
	var n int
	require.NoError(t, adminPool(b).QueryRow(ctx, "SELECT count(*) FROM "+b.table).Scan(&n))
	require.Zero(t, n, "a statement was applied")
}

// lib/pq without binary_parameters=yes through PgBouncer in transaction
// mode binds its statements to other clients' unnamed statements: the
// first statement is refused with ErrPoolerSettings, which says what to
// set, and nothing is applied.
func TestDBPgBouncerLibPQNeedsBinaryParameters(t *testing.T) {
	t.Parallel()
	bouncer := pgtest.NewPgBouncer(t, pgtest.PoolTransaction, nil)
	b := bouncerDBBackend(t, bouncer, "pq", nil, Options{DisableNotify: true})
	ctx := testCtx(t)
	_, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o"})
	t.Log(err)
	require.ErrorIs(t, err, ErrPoolerSettings)
	require.Contains(t, err.Error(), "binary_parameters=yes")
	_, err = b.TryRenew(ctx, sqllock.Lease{Key: "k", Token: 1, Owner: "o"}, time.Minute)
	require.ErrorIs(t, err, ErrPoolerSettings)
	var n int
	require.NoError(t, adminPool(b).QueryRow(ctx, "SELECT count(*) FROM "+b.table).Scan(&n))
	require.Zero(t, n, "a statement was applied")
}

// lib/pq through PgBouncer never prepares (its statement names, "1",
// "2", ... per connection, could meet another client's behind
// transaction pooling), in either pool mode, with or without
// Options.UnnamedStatements: every statement goes unnamed and works.
func TestDBPgBouncerLibPQUnnamed(t *testing.T) {
	t.Parallel()
	for _, mode := range []string{pgtest.PoolTransaction, pgtest.PoolSession} {
		t.Run(mode, func(t *testing.T) {
			t.Parallel()
			bouncer := pgtest.NewPgBouncer(t, mode, nil)
			for _, unnamed := range []bool{false, true} {
				t.Run(fmt.Sprintf("unnamed=%v", unnamed), func(t *testing.T) {
					t.Parallel()
					var params map[string]string
					opts := Options{UnnamedStatements: unnamed, DisableNotify: mode == pgtest.PoolTransaction}
					if mode == pgtest.PoolTransaction {
						params = transactionParams["pq"]
					}
					b := bouncerDBBackend(t, bouncer, "pq", params, opts)
					ctx := testCtx(t)
					for i := range 20 {
						l := acquireOK(t, b, "k", "o", time.Minute)
						require.EqualValues(t, i+1, l.Token)
						_, err := b.TryRenew(ctx, l, time.Minute)
						require.NoError(t, err)
						require.NoError(t, b.Release(ctx, l))
					}
					require.False(t, b.named(), "statements prepared behind a pooler")
					if b.prepared != nil {
						require.Zero(t, b.prepared.size())
					}
				})
			}
		})
	}
}
