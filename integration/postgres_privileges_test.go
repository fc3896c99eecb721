package integration

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/dialect/postgres"
	"github.com/ashlock/ashlock/internal/testkit/pgtest"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
	"github.com/ashlock/ashlock/sqllock/backendtest"
)

// privPool opens a pool on db's schema as user with password.
func privPool(t *testing.T, db *pgtest.DB, user, password string, params map[string]string) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	cfg.ConnConfig.User = user
	cfg.ConnConfig.Password = password
	cfg.ConnConfig.ConnectTimeout = 5 * time.Second
	cfg.MaxConns = 6
	for k, v := range params {
		cfg.ConnConfig.RuntimeParams[k] = v
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	return pool
}

// requirePermissionDenied checks that err is PostgreSQL's
// insufficient_privilege (42501).
func requirePermissionDenied(t *testing.T, err error, msgAndArgs ...any) {
	t.Helper()
	require.Error(t, err, msgAndArgs...)
	pgErr, ok := errors.AsType[*pgconn.PgError](err)
	require.True(t, ok, "want a PostgreSQL error, got %v", err)
	require.Equal(t, "42501", pgErr.Code, "want insufficient_privilege, got %v", err)
}

// TestPostgresLeastPrivilege runs every runtime operation as a login role
// that has USAGE on the schema and only SELECT, INSERT and UPDATE on the
// lock table: no DELETE, no TRUNCATE, no CREATE anywhere. That is all the
// backend needs (LISTEN/NOTIFY need no grant, and FOR SHARE in FencedTx is
// covered by UPDATE). Applying the migrations needs more, and fails as that
// role.
func TestPostgresLeastPrivilege(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	migrateUp(ctx, t, db)

	var buf [6]byte
	_, _ = rand.Read(buf[:])
	role := "sqllock_app_" + hex.EncodeToString(buf[:])
	_, _ = rand.Read(buf[:])
	password := hex.EncodeToString(buf[:]) // trust auth ignores it; scram (a container) needs it
	roleID, schemaID := pgx.Identifier{role}.Sanitize(), pgx.Identifier{db.Schema}.Sanitize()
	tableID := pgx.Identifier{db.Schema, migrations.DefaultTable}.Sanitize()
	_, err := db.Pool.Exec(ctx, "CREATE ROLE "+roleID+" LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOINHERIT PASSWORD '"+password+"'")
	require.NoError(t, err)
	// Registered before the pools' cleanups, so it runs after them; and
	// before pgtest drops the schema (cleanups run last in, first out).
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, err := db.Pool.Exec(ctx, "DROP OWNED BY "+roleID)
		require.NoError(t, err)
		_, err = db.Pool.Exec(ctx, "DROP ROLE "+roleID)
		require.NoError(t, err)
	})
	_, err = db.Pool.Exec(ctx, "GRANT USAGE ON SCHEMA "+schemaID+" TO "+roleID+"; "+
		"GRANT SELECT, INSERT, UPDATE ON "+tableID+" TO "+roleID)
	require.NoError(t, err)
	var privs struct{ create, tableDelete, tableTruncate, dbCreate, super bool }
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT has_schema_privilege($1, $2, 'CREATE'),
			has_table_privilege($1, $3, 'DELETE'), has_table_privilege($1, $3, 'TRUNCATE'),
			has_database_privilege($1, current_database(), 'CREATE'), rolsuper
		FROM pg_roles WHERE rolname = $1`, role, db.Schema, tableID).
		Scan(&privs.create, &privs.tableDelete, &privs.tableTruncate, &privs.dbCreate, &privs.super))
	require.Zero(t, privs, "the role must have no CREATE, DELETE, TRUNCATE or superuser")

	pool := privPool(t, db, role, password, nil)
	defer pool.Close()
	var who string
	require.NoError(t, pool.QueryRow(ctx, "SELECT current_user").Scan(&who))
	require.Equal(t, role, who)
	_, err = pool.Exec(ctx, "DELETE FROM "+tableID)
	requirePermissionDenied(t, err, "the role must not be able to delete")

	newClient := func(owner string, backoff func(int) time.Duration) (*sqllock.Client, *postgres.Backend) {
		be, err := postgres.New(pool, postgres.Options{Schema: db.Schema})
		require.NoError(t, err)
		c, err := sqllock.New(be, sqllock.Options{Owner: owner, TTL: 30 * time.Second, Backoff: backoff})
		require.NoError(t, err)
		return c, be
	}
	a, beA := newClient("priv-a", nil)
	defer func() { require.NoError(t, beA.Close()) }()
	defer func() { require.NoError(t, a.Close(ctx)) }()
	// b polls only every 10 s: when it gets the key sooner after a release,
	// the notification woke it.
	b, beB := newClient("priv-b", func(int) time.Duration { return 10 * time.Second })
	defer func() { require.NoError(t, beB.Close()) }()
	defer func() { require.NoError(t, b.Close(ctx)) }()

	// TryAcquire (first insert of the key), held refusal, renew.
	g1, err := a.TryAcquire(ctx, "k", nil)
	require.NoError(t, err)
	require.Equal(t, int64(1), g1.Token())
	_, err = b.TryAcquire(ctx, "k", nil)
	var he *sqllock.HeldError
	require.ErrorAs(t, err, &he)
	require.Contains(t, he.Owner, "priv-a")
	before := g1.Lease().Deadline
	l, err := g1.Renew(ctx)
	require.NoError(t, err)
	require.True(t, l.Deadline.After(before), "renew moved the deadline")

	// List.
	infos, err := beA.List(ctx, "")
	require.NoError(t, err)
	require.Len(t, infos, 1)
	require.True(t, infos[0].Held)
	require.Equal(t, int64(1), infos[0].Token)

	// FencedTx: the share lock needs UPDATE (granted), and fn runs as the role.
	err = beA.FencedTx(ctx, g1.Lease(), func(tx pgx.Tx) error {
		var user string
		if err := tx.QueryRow(ctx, "SELECT current_user").Scan(&user); err != nil {
			return err
		}
		if user != role {
			return errors.New("fenced transaction runs as " + user)
		}
		return nil
	})
	require.NoError(t, err)

	// Release, then a grant through the UPDATE path.
	require.NoError(t, g1.Release(ctx))
	err = beA.FencedTx(ctx, g1.Lease(), func(pgx.Tx) error { return errors.New("ran under a released lease") })
	require.ErrorIs(t, err, sqllock.ErrLeaseLost)
	g2, err := a.TryAcquire(ctx, "k", nil)
	require.NoError(t, err)
	require.Equal(t, int64(2), g2.Token())

	// Watch wake-up: b waits on the key held by a; once b's listener is
	// LISTENing (as the role), a releases and b gets the key long before its
	// 10 s poll.
	type result struct {
		g   *sqllock.Guard
		err error
		at  time.Time
	}
	got := make(chan result, 1)
	go func() {
		g, err := b.Acquire(ctx, "k", &sqllock.AcquireOptions{Wait: 30 * time.Second})
		got <- result{g, err, time.Now()}
	}()
	robustEventually(t, 10*time.Second, func() bool {
		var n int
		err := db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
			WHERE usename = $1 AND state = 'idle' AND query LIKE 'LISTEN %'`, role).Scan(&n)
		return err == nil && n == 1
	}, "b's listener never LISTENed as %s", role)
	released := time.Now()
	require.NoError(t, g2.Release(ctx))
	var r result
	select {
	case r = <-got:
	case <-time.After(8 * time.Second):
		t.Fatal("the waiter was not woken by the release's notification")
	}
	require.NoError(t, r.err)
	require.Equal(t, int64(3), r.g.Token())
	woke := r.at.Sub(released)
	// "Waking at once": the notification's delivery plus an allowance for
	// a loaded 2-core machine; b's next poll is 10 s away. Measured: at most
	// 26 ms over 5 idle runs, 44 ms over 5 runs under -race with three busy
	// loops competing for the two cores.
	require.LessOrEqual(t, woke, wakeBound, "the waiter woke %v after the release: by polling, not by the notification?", woke)
	require.NoError(t, r.g.Release(ctx))

	// A set of keys and its release in one statement, and a permit: the
	// grant and the release of locked rows are INSERT ... ON CONFLICT DO
	// UPDATE statements, which need INSERT and UPDATE (both granted).
	ls, err := beA.TryAcquireAll(ctx, sqllock.MultiAcquireRequest{Keys: []string{"s2", "s1", "k"}, TTL: time.Minute, Owner: "priv-set"})
	require.NoError(t, err)
	require.Len(t, ls, 3)
	ls, err = beA.TryAcquireAll(ctx, sqllock.MultiAcquireRequest{Keys: []string{"s2", "s1", "k"}, TTL: time.Minute, Owner: "priv-set"})
	require.NoError(t, err, "the same owner's repeat updates the rows it holds")
	answers, err := beA.ReleaseAll(ctx, ls)
	require.NoError(t, err)
	require.NoError(t, errors.Join(answers...))
	pl, err := beA.TryAcquirePermit(ctx, sqllock.PermitRequest{AcquireRequest: sqllock.AcquireRequest{Key: "sem", TTL: time.Minute, Owner: "priv-permit"}, Permits: 2})
	require.NoError(t, err)
	require.NoError(t, beA.Release(ctx, pl))

	// Compacting needs the owner's rights (VACUUM, REINDEX): refused before
	// any row moved (no row has a new version: the ctids stay).
	ctids := func() (s string) {
		require.NoError(t, db.Pool.QueryRow(ctx, "SELECT string_agg(ctid::text || key, ',' ORDER BY key) FROM "+tableID).Scan(&s))
		return s
	}
	was := ctids()
	_, err = beA.Compact(ctx)
	require.ErrorIs(t, err, postgres.ErrNotOwner)
	require.Equal(t, was, ctids(), "a refused compaction moved rows")

	// Migrations need more than the runtime: as the role, Up fails both on
	// a fresh schema (no CREATE on the database) and in the schema it may
	// use (no CREATE there either), and leaves nothing behind. (goose tries
	// to create its version table 3 times, 1 s apart, before it gives up:
	// the two run concurrently to keep the test short.)
	roleDB := stdlib.OpenDBFromPool(pool)
	defer func() { require.NoError(t, roleDB.Close()) }()
	fresh := db.Schema + "_fresh"
	var errFresh, errOther error
	var wg sync.WaitGroup
	wg.Go(func() {
		errFresh = migrations.Up(ctx, migrations.Postgres, roleDB, migrations.Options{Schema: fresh})
	})
	wg.Go(func() {
		errOther = migrations.Up(ctx, migrations.Postgres, roleDB, migrations.Options{Schema: db.Schema, Table: "other_locks"})
	})
	wg.Wait()
	requirePermissionDenied(t, errFresh, "Up on a fresh schema as the runtime role")
	requirePermissionDenied(t, errOther, "Up of another table in the role's schema")
	var schemas, tables int
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_namespace WHERE nspname = $1", fresh).Scan(&schemas))
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_tables WHERE schemaname = $1 AND tablename LIKE 'other_locks%'", db.Schema).Scan(&tables))
	require.Zero(t, schemas+tables, "a failed Up created something")
	t.Logf("role %s (SELECT, INSERT, UPDATE on %s): acquire, held, renew, list, fenced tx, release, watch wake-up in %v, set and permit: ok; migrations refused",
		role, tableID, woke.Round(time.Millisecond))
}

// TestPostgresReadOnlySession: a session with default_transaction_read_only
// (as on a hot standby reached after a failover) makes TryAcquire fail at
// once with an error matching ErrUnavailable that says read-only, not a
// wait, a hang or a misleading "held".
// wakeBound bounds the time from a release to the waiting Acquire's return
// on PostgreSQL (the README: a waiter wakes "at once" on a release signal).
const wakeBound = backendtest.WakeBound // 500 ms: see there

func TestPostgresReadOnlySession(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	migrateUp(ctx, t, db)

	cfg, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	cfg.ConnConfig.RuntimeParams["default_transaction_read_only"] = "on"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()
	be, err := postgres.New(pool, postgres.Options{Schema: db.Schema})
	require.NoError(t, err)
	defer func() { require.NoError(t, be.Close()) }()
	c, err := sqllock.New(be, sqllock.Options{TTL: 10 * time.Second})
	require.NoError(t, err)
	defer func() { require.NoError(t, c.Close(ctx)) }()

	start := time.Now()
	g, err := c.TryAcquire(ctx, "k", nil)
	took := time.Since(start)
	require.Nil(t, g)
	require.ErrorIs(t, err, sqllock.ErrUnavailable)
	require.NotErrorIs(t, err, sqllock.ErrNotAcquired)
	require.ErrorContains(t, err, "read-only")
	// The pool is cold: the bound covers a dial and a startup on a loaded
	// machine too (typically it takes milliseconds: see the log line); a
	// wait or a retry loop would take far longer.
	require.Less(t, took, 5*time.Second, "a read-only session must fail fast")
	t.Logf("read-only TryAcquire failed in %v: %v", took.Round(time.Millisecond), err)
}
