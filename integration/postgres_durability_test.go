package integration

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"io"
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

// Grants and renewals are durable whatever the session says (G2, G3).
// Applications commonly run their pool with synchronous_commit=off (in the
// DSN, ALTER ROLE or ALTER DATABASE) for throughput; a grant acknowledged
// on such a session could vanish in a server crash, and the next grant
// would repeat its token, which a fence `token >= highest seen` accepts
// from both holders.

// durabilityServer starts a dedicated durable server with settings, migrates
// it with an admin pool (which it returns), and returns the server.
func durabilityServer(t *testing.T, settings map[string]string) (*pgtest.Server, *pgxpool.Pool) {
	t.Helper()
	srv := pgtest.NewServer(t, pgtest.ServerOptions{Durable: true, Settings: settings})
	admin := restartPool(t, srv.URL, "durability-admin", 2)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	sqlDB := stdlib.OpenDBFromPool(admin)
	require.NoError(t, migrations.Up(ctx, migrations.Postgres, sqlDB, migrations.Options{}))
	require.NoError(t, sqlDB.Close())
	return srv, admin
}

// appBackend opens a pool whose sessions run with synchronous_commit at
// level, and a Backend on it.
func appBackend(t *testing.T, url, level string) (*pgxpool.Pool, *postgres.Backend) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	require.NoError(t, err)
	cfg.MaxConns = 4
	cfg.ConnConfig.ConnectTimeout = time.Second
	cfg.ConnConfig.RuntimeParams["synchronous_commit"] = level
	cfg.ConnConfig.RuntimeParams["application_name"] = "durability-app"
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	var got string
	require.NoError(t, pool.QueryRow(ctx, "SHOW synchronous_commit").Scan(&got))
	require.Equal(t, level, got, "the application's sessions run at this level")
	be, err := postgres.New(pool, postgres.Options{})
	require.NoError(t, err)
	return pool, be
}

// TestPostgresGrantSurvivesCrashOnAsyncSession: on a session with
// synchronous_commit=off, grant, crash the server (pg_ctl stop -m
// immediate), start it again: the grant is there; renew, crash again: the
// renewed deadline is there, and the next grant's token is greater. Each
// crash follows one statement alone, so that no later durable commit can
// flush an asynchronous one before it: round 1 grants with the first
// insert, the others with the UPDATE. wal_writer_delay is raised to its
// maximum (10 s) and autovacuum is off, so nothing else flushes the WAL
// inside the window: an asynchronous grant or renewal is lost on every
// round.
func TestPostgresGrantSurvivesCrashOnAsyncSession(t *testing.T) {
	t.Parallel()
	// The Backend on a pgx pool, and on a *sql.DB through each driver.
	for _, driver := range []string{"pgxpool", "pgx", "postgres"} {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			grantSurvivesCrashOnAsyncSession(t, func(url string) (io.Closer, *postgres.Backend) {
				if driver == "pgxpool" {
					pool, be := appBackend(t, url, "off")
					return closerFunc(pool.Close), be
				}
				db, err := sql.Open(driver, url+"&synchronous_commit=off&application_name=durability-app")
				require.NoError(t, err)
				var got string
				require.NoError(t, db.QueryRowContext(t.Context(), "SHOW synchronous_commit").Scan(&got))
				require.Equal(t, "off", got, "the application's sessions run at this level")
				be, err := postgres.NewDB(db, postgres.Options{})
				require.NoError(t, err)
				return db, be
			})
		})
	}
}

// closerFunc is a func() as an io.Closer.
type closerFunc func()

func (f closerFunc) Close() error { f(); return nil }

func grantSurvivesCrashOnAsyncSession(t *testing.T, open func(url string) (io.Closer, *postgres.Backend)) {
	srv, _ := durabilityServer(t, map[string]string{"wal_writer_delay": "10s", "autovacuum": "off"})
	const key, rounds = "nightly", 3
	last := int64(0)
	crashes := 0
	// crash stops the server at once, starts it again and reads key's row.
	crash := func(ctx context.Context) (token int64, held bool, deadline time.Time) {
		t.Helper()
		require.NoError(t, srv.Stop(pgtest.StopImmediate))
		require.NoError(t, srv.Start())
		crashes++
		admin := restartPool(t, srv.URL, "durability-check", 1)
		defer admin.Close()
		err := admin.QueryRow(ctx, "SELECT token, held, deadline FROM sqllock_locks WHERE key = $1", key).Scan(&token, &held, &deadline)
		if errors.Is(err, pgx.ErrNoRows) {
			return 0, false, time.Time{}
		}
		require.NoError(t, err)
		return token, held, deadline
	}
	for round := 1; round <= rounds; round++ {
		ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
		pool, be := open(srv.URL)
		l, err := be.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: fmt.Sprintf("round-%d", round)})
		require.NoError(t, err, "round %d", round)
		require.Greater(t, l.Token, last, "round %d: a token was handed out twice", round)
		require.NoError(t, be.Close())
		pool.Close()
		token, held, _ := crash(ctx)
		require.Equal(t, l.Token, token, "round %d: the acknowledged grant of token %d was lost in the crash", round, l.Token)
		require.True(t, held, "round %d: the acknowledged grant was lost in the crash", round)

		pool, be = open(srv.URL)
		renewed, err := be.TryRenew(ctx, l, time.Hour)
		require.NoError(t, err)
		require.NoError(t, be.Close())
		pool.Close()
		token, held, deadline := crash(ctx)
		require.Equal(t, l.Token, token)
		require.True(t, held)
		require.False(t, deadline.Before(renewed.Deadline), "round %d: the acknowledged renewal was lost in the crash (deadline %v, renewed to %v)", round, deadline, renewed.Deadline)

		// End the lease so that the next round's grant is a new tenure.
		admin := restartPool(t, srv.URL, "durability-check", 1)
		_, err = admin.Exec(ctx, "UPDATE sqllock_locks SET deadline = clock_timestamp() WHERE key = $1", key)
		require.NoError(t, err)
		admin.Close()
		last = l.Token
		cancel()
	}
	t.Logf("RESULT test=%s rounds=%d crashes=%d last_token=%d", t.Name(), rounds, crashes, last)
}

// TestPostgresGrantWaitsForSynchronousStandby: a server that names a
// synchronous standby, sessions at synchronous_commit=local. A grant and a
// renewal must wait for the standby (an acknowledged grant must survive a
// failover); the standby here never connects, so they wait until the
// caller's context ends, and report an outcome they cannot know. A refused
// acquire commits nothing and answers at once, and a release keeps its
// deliberate asynchronous commit.
func TestPostgresGrantWaitsForSynchronousStandby(t *testing.T) {
	t.Parallel()
	_, admin := durabilityServerWithStandby(t)
	_, be := appBackendOn(t, admin.Config().ConnString(), "local")
	ctx := t.Context()
	_, err := admin.Exec(ctx, `INSERT INTO sqllock_locks (key, token, held, deadline, owner)
		VALUES ('held', 5, true, clock_timestamp() + interval '1 hour', 'other')`)
	require.NoError(t, err)

	const wait = 500 * time.Millisecond
	call := func(f func(ctx context.Context) error) (time.Duration, error) {
		ctx, cancel := context.WithTimeout(ctx, wait)
		defer cancel()
		start := time.Now()
		err := f(ctx)
		return time.Since(start), err
	}

	took, err := call(func(ctx context.Context) error {
		_, err := be.TryAcquire(ctx, sqllock.AcquireRequest{Key: "new", TTL: time.Minute, Owner: "me"})
		return err
	})
	require.ErrorIs(t, err, sqllock.ErrIndeterminate, "a grant on a local session did not wait for the synchronous standby (%v)", took)

	took, err = call(func(ctx context.Context) error {
		_, err := be.TryRenew(ctx, sqllock.Lease{Key: "held", Token: 5, Owner: "other"}, time.Hour)
		return err
	})
	require.ErrorIs(t, err, sqllock.ErrUnavailable, "a renewal on a local session did not wait for the synchronous standby (%v)", took)

	took, err = call(func(ctx context.Context) error {
		_, err := be.TryAcquire(ctx, sqllock.AcquireRequest{Key: "held", TTL: time.Minute, Owner: "me"})
		return err
	})
	require.ErrorIs(t, err, sqllock.ErrNotAcquired, "a refused acquire commits nothing and waits for nothing (%v)", took)

	took, err = call(func(ctx context.Context) error {
		return be.Release(ctx, sqllock.Lease{Key: "held", Token: 5, Owner: "other"})
	})
	require.NoError(t, err, "a release commits asynchronously and waits for no standby (%v)", took)
}

// durabilityServerWithStandby is durabilityServer on a server that names a
// synchronous standby that never connects. The server's own default is
// synchronous_commit=local, so that the migrations (and the test's admin
// statements) do not wait for it.
func durabilityServerWithStandby(t *testing.T) (*pgtest.Server, *pgxpool.Pool) {
	t.Helper()
	return durabilityServer(t, map[string]string{
		"synchronous_standby_names": "absent_standby",
		"synchronous_commit":        "local",
	})
}

func appBackendOn(t *testing.T, url, level string) (*pgxpool.Pool, *postgres.Backend) {
	t.Helper()
	pool, be := appBackend(t, url, level)
	t.Cleanup(func() {
		require.NoError(t, be.Close())
		pool.Close()
	})
	return pool, be
}
