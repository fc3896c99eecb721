package integration

import (
	"context"
	"database/sql"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/stdlib"
	_ "github.com/lib/pq" // registers "postgres"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/dialect/postgres"
	"github.com/ashlock/ashlock/internal/testkit/pgtest"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// TestPostgresDBCancelledSyncWaitIsIndeterminate is
// TestPostgresCancelledSyncWaitIsIndeterminate for the Backend on a
// *sql.DB, through each driver's way of ending a statement with its
// context: pgx's stdlib driver gives the connection up (an error in
// flight), lib/pq sends a cancel request, and the server then answers
// the grant, and the fenced commit, as committed, with a WARNING that
// lib/pq keeps to itself. Neither may read as a success: the standby
// never received them.
func TestPostgresDBCancelledSyncWaitIsIndeterminate(t *testing.T) {
	t.Parallel()
	cluster := newHACluster(t, true, nil)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	admin := restartPool(t, cluster.primary.URL+"&synchronous_commit=local", "dbsyncwait-admin", 2)
	migrate := stdlib.OpenDBFromPool(admin)
	require.NoError(t, migrations.Up(ctx, migrations.Postgres, migrate, migrations.Options{}))
	require.NoError(t, migrate.Close())
	_, err := admin.Exec(ctx, "CREATE TABLE fenced_writes (k text)")
	require.NoError(t, err)
	require.NoError(t, cluster.primary.WaitStreaming(ctx, standbyName, "sync"))
	require.NoError(t, cluster.standby.Stop(pgtest.StopFast))

	for _, driver := range []string{"pgx", "postgres"} {
		db, err := sql.Open(driver, cluster.primary.URL+"&synchronous_commit=local")
		require.NoError(t, err)
		t.Cleanup(func() { db.Close() })
		be, err := postgres.NewDB(db, postgres.Options{})
		require.NoError(t, err)
		t.Cleanup(func() { be.Close() })

		key := "grant-" + driver
		cctx, ccancel := context.WithTimeout(ctx, 500*time.Millisecond)
		_, err = be.TryAcquire(cctx, sqllock.AcquireRequest{Key: key, TTL: time.Hour, Owner: "me"})
		ccancel()
		t.Logf("%s: grant: %v", driver, err)
		require.ErrorIs(t, err, sqllock.ErrIndeterminate, "%s: a grant whose wait for the standby was cancelled", driver)

		// lib/pq's cancel request ended the wait: the local commit is
		// visible. (pgx's closed connection leaves its server session
		// waiting for the standby, the commit invisible until then.)
		if driver == "postgres" {
			var held bool
			require.NoError(t, admin.QueryRow(ctx, "SELECT held FROM sqllock_locks WHERE key = $1", key).Scan(&held))
			require.True(t, held, "%s: the grant committed locally", driver)
		}

		// A fenced commit at the primary's synchronous_commit (on): the
		// fence and fn run at once, the commit waits for the standby.
		fdb, err := sql.Open(driver, cluster.primary.URL)
		require.NoError(t, err)
		t.Cleanup(func() { fdb.Close() })
		fbe, err := postgres.NewDB(fdb, postgres.Options{})
		require.NoError(t, err)
		t.Cleanup(func() { fbe.Close() })
		fkey := "fenced-" + driver
		_, err = admin.Exec(ctx, `INSERT INTO sqllock_locks (key, token, held, deadline, owner)
			VALUES ($1, 7, true, clock_timestamp() + interval '1 hour', 'me')`, fkey)
		require.NoError(t, err)
		cctx, ccancel = context.WithTimeout(ctx, 500*time.Millisecond)
		err = fbe.FencedSQLTx(cctx, sqllock.Lease{Key: fkey, Token: 7, Owner: "me"}, func(tx *sql.Tx) error {
			_, err := tx.ExecContext(cctx, "INSERT INTO fenced_writes VALUES ($1)", fkey)
			return err
		})
		ccancel()
		t.Logf("%s: fenced commit: %v", driver, err)
		require.ErrorIs(t, err, sqllock.ErrIndeterminate, "%s: a fenced commit whose wait for the standby was cancelled", driver)
		if driver == "postgres" {
			var n int
			require.NoError(t, admin.QueryRow(ctx, "SELECT count(*) FROM fenced_writes WHERE k = $1", fkey).Scan(&n))
			require.Equal(t, 1, n, "%s: the fenced write committed locally", driver)
		}
	}

	// An operator's pg_cancel_backend while the caller's context lives:
	// the server answers as committed, with a WARNING that only
	// postgres.OnNotice in the *sql.DB's pgx configuration lets the
	// Backend see (pgx's stdlib driver).
	cfg, err := pgx.ParseConfig(cluster.primary.URL + "&application_name=dbsyncwait-operator")
	require.NoError(t, err)
	cfg.OnNotice = postgres.OnNotice(nil)
	db := stdlib.OpenDB(*cfg)
	t.Cleanup(func() { db.Close() })
	be, err := postgres.NewDB(db, postgres.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { be.Close() })
	byOperator := func(what string, f func() error) error {
		done := make(chan error, 1)
		go func() { done <- f() }()
		var pid int
		require.Eventually(t, func() bool {
			return admin.QueryRow(ctx, `SELECT pid FROM pg_stat_activity
				WHERE application_name = 'dbsyncwait-operator' AND wait_event = 'SyncRep'`).Scan(&pid) == nil
		}, 10*time.Second, 5*time.Millisecond, "%s never waited for the standby", what)
		var ok bool
		require.NoError(t, admin.QueryRow(ctx, "SELECT pg_cancel_backend($1)", pid).Scan(&ok))
		require.True(t, ok)
		select {
		case err := <-done:
			return err
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: no answer 10s after pg_cancel_backend", what)
			return nil
		}
	}
	err = byOperator("grant", func() error {
		_, err := be.TryAcquire(ctx, sqllock.AcquireRequest{Key: "grant-operator", TTL: time.Hour, Owner: "me"})
		return err
	})
	t.Logf("operator: grant: %v", err)
	require.ErrorIs(t, err, sqllock.ErrIndeterminate, "a grant whose wait an operator cancelled")
	_, err = admin.Exec(ctx, `INSERT INTO sqllock_locks (key, token, held, deadline, owner)
		VALUES ('fenced-operator', 7, true, clock_timestamp() + interval '1 hour', 'me')`)
	require.NoError(t, err)
	err = byOperator("fenced commit", func() error {
		return be.FencedSQLTx(ctx, sqllock.Lease{Key: "fenced-operator", Token: 7, Owner: "me"}, func(tx *sql.Tx) error {
			_, err := tx.ExecContext(ctx, "INSERT INTO fenced_writes VALUES ('fenced-operator')")
			return err
		})
	})
	t.Logf("operator: fenced commit: %v", err)
	require.ErrorIs(t, err, sqllock.ErrIndeterminate, "a fenced commit whose wait an operator cancelled")
}
