package integration

import (
	"context"
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

// A fenced transaction whose COMMIT waits for a synchronous standby has
// committed locally. When the server ends the session meanwhile (FATAL
// 57P01: pg_terminate_backend here, pg_ctl stop -m immediate in a
// failover), FencedTx reports ErrIndeterminate, never a failure that says
// the write was not applied: the write is there.
func TestPostgresFencedCommitTerminatedIsIndeterminate(t *testing.T) {
	t.Parallel()
	// A standby that never comes: every commit at synchronous_commit=on
	// waits for it.
	srv := pgtest.NewServer(t, pgtest.ServerOptions{Durable: true, Settings: map[string]string{"synchronous_standby_names": "nosuch"}})
	admin := restartPool(t, srv.URL+"&synchronous_commit=local", "terminated-admin", 2)
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	sqlDB := stdlib.OpenDBFromPool(admin)
	require.NoError(t, migrations.Up(ctx, migrations.Postgres, sqlDB, migrations.Options{}))
	require.NoError(t, sqlDB.Close())
	_, err := admin.Exec(ctx, `CREATE TABLE fenced_counter (n bigint NOT NULL); INSERT INTO fenced_counter VALUES (0);
		INSERT INTO sqllock_locks (key, token, held, deadline, owner) VALUES ('k', 5, true, clock_timestamp() + interval '1 hour', 'me')`)
	require.NoError(t, err)

	cfg, err := pgxpool.ParseConfig(srv.URL)
	require.NoError(t, err)
	cfg.MaxConns = 2
	cfg.ConnConfig.RuntimeParams["application_name"] = "terminated-app"
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	be, err := postgres.New(pool, postgres.Options{DisableNotify: true})
	require.NoError(t, err)
	t.Cleanup(func() { be.Close() })

	lease := sqllock.Lease{Key: "k", Token: 5, Owner: "me", Deadline: time.Now().Add(time.Hour), BackendTime: time.Now()}
	done := make(chan error, 1)
	go func() {
		done <- be.FencedTx(ctx, lease, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, "UPDATE fenced_counter SET n = n + 1")
			return err
		})
	}()
	var pid int
	require.Eventually(t, func() bool {
		return admin.QueryRow(ctx, `SELECT pid FROM pg_stat_activity WHERE application_name = 'terminated-app' AND wait_event = 'SyncRep'`).Scan(&pid) == nil
	}, 20*time.Second, 5*time.Millisecond, "the fenced commit never waited for the standby")
	var ok bool
	require.NoError(t, admin.QueryRow(ctx, "SELECT pg_terminate_backend($1)", pid).Scan(&ok))
	require.True(t, ok)
	var got error
	select {
	case got = <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("FencedTx did not return 20s after its session was terminated")
	}
	t.Logf("FencedTx: %v", got)
	var n int64
	require.NoError(t, admin.QueryRow(ctx, "SELECT n FROM fenced_counter").Scan(&n))
	require.EqualValues(t, 1, n, "the commit was not applied locally: the test proves nothing")
	require.ErrorIs(t, got, sqllock.ErrIndeterminate, "a commit the server may have applied was reported as failed")
}
