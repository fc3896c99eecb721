package integration

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgconn/ctxwatch"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/dialect/postgres"
	"github.com/ashlock/ashlock/internal/testkit/pgtest"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// TestPostgresCancelledSyncWaitIsIndeterminate: a commit that waits for a
// synchronous standby has committed locally; when the wait is cancelled,
// PostgreSQL keeps the commit, sends a WARNING ("canceling wait for
// synchronous replication due to user request") and answers as for a
// success. A failover to the standby, which never received it, loses it.
// So the Backend must report such a grant (and a fenced commit) as
// ErrIndeterminate, and such a renewal as ErrUnavailable, never as a
// success (the token would be handed out again after the failover) nor as
// a failure (it did commit, locally).
//
// The standby is stopped; the application's sessions run at
// synchronous_commit=local, which grants raise to on. The wait is
// cancelled three ways: by the caller's context with pgx's default context
// watcher (it closes the connection: an error in flight), by the caller's
// context with pgconn.CancelRequestContextWatcherHandler (a cancel request:
// the server's reply is a success), and by an operator's pg_cancel_backend
// while the caller's context lives (a success too, recognisable only by
// its WARNING: the pool needs postgres.OnNotice). Each grant is then on
// the old primary; after the failover to the standby none is, and the new
// primary grants the same tokens again.
func TestPostgresCancelledSyncWaitIsIndeterminate(t *testing.T) {
	t.Parallel()
	cluster := newHACluster(t, true, nil)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	admin := restartPool(t, cluster.primary.URL+"&synchronous_commit=local", "syncwait-admin", 2)
	sqlDB := stdlib.OpenDBFromPool(admin)
	require.NoError(t, migrations.Up(ctx, migrations.Postgres, sqlDB, migrations.Options{}))
	require.NoError(t, sqlDB.Close())
	// Leases to renew, granted while the standby streams.
	_, err := admin.Exec(ctx, `INSERT INTO sqllock_locks (key, token, held, deadline, owner)
		SELECT 'renew-' || i, 7, true, clock_timestamp() + interval '1 hour', 'holder' FROM generate_series(1, 3) AS i`)
	require.NoError(t, err)
	require.NoError(t, cluster.primary.WaitStreaming(ctx, standbyName, "sync"))
	require.NoError(t, cluster.standby.Stop(pgtest.StopFast))

	// pool is an application pool; the wait of its calls ends with their
	// context, or by pg_cancel_backend when byOperator.
	type pool struct {
		name       string
		be         *postgres.Backend
		byOperator bool
	}
	app := func(name string, configure func(*pgxpool.Config)) *postgres.Backend {
		cfg, err := pgxpool.ParseConfig(cluster.primary.URL)
		require.NoError(t, err)
		cfg.MaxConns = 2
		cfg.ConnConfig.RuntimeParams["synchronous_commit"] = "local"
		cfg.ConnConfig.RuntimeParams["application_name"] = "syncwait-" + name
		if configure != nil {
			configure(cfg)
		}
		p, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		t.Cleanup(p.Close)
		be, err := postgres.New(p, postgres.Options{})
		require.NoError(t, err)
		t.Cleanup(func() { be.Close() })
		return be
	}
	cancelRequest := func(cfg *pgxpool.Config) {
		cfg.ConnConfig.BuildContextWatcherHandler = func(c *pgconn.PgConn) ctxwatch.Handler {
			return &pgconn.CancelRequestContextWatcherHandler{Conn: c, DeadlineDelay: 10 * time.Second}
		}
	}
	pools := []pool{
		{name: "deadline", be: app("deadline", nil)},
		{name: "cancel-request", be: app("cancel-request", cancelRequest)},
		{name: "operator", be: app("operator", func(cfg *pgxpool.Config) {
			cfg.ConnConfig.OnNotice = postgres.OnNotice(cfg.ConnConfig.OnNotice)
		}), byOperator: true},
	}
	// The control: an operator's cancel without OnNotice. PostgreSQL's
	// reply is a success, and a WARNING the pool drops is all that says
	// otherwise.
	blind := app("blind", nil)

	// call runs f with a context that the wait ends by its pool's way.
	var waits atomic.Int64
	call := func(p pool, f func(ctx context.Context) error) error {
		if !p.byOperator {
			cctx, ccancel := context.WithTimeout(ctx, 500*time.Millisecond)
			defer ccancel()
			return f(cctx)
		}
		done := make(chan error, 1)
		go func() { done <- f(ctx) }()
		var pid int
		require.Eventually(t, func() bool {
			err := admin.QueryRow(ctx, `SELECT pid FROM pg_stat_activity
				WHERE application_name = $1 AND wait_event = 'SyncRep'`, "syncwait-"+p.name).Scan(&pid)
			return err == nil
		}, 10*time.Second, 5*time.Millisecond, "%s: the statement never waited for the standby", p.name)
		waits.Add(1)
		var ok bool
		require.NoError(t, admin.QueryRow(ctx, "SELECT pg_cancel_backend($1)", pid).Scan(&ok))
		require.True(t, ok)
		select {
		case err := <-done:
			return err
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: no answer 10s after pg_cancel_backend", p.name)
			return nil
		}
	}

	var summary []string
	for i, p := range pools {
		key := "grant-" + p.name
		err := call(p, func(ctx context.Context) error {
			_, err := p.be.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: time.Hour, Owner: "me"})
			return err
		})
		t.Logf("%s: grant: %v", p.name, err)
		require.ErrorIs(t, err, sqllock.ErrIndeterminate, "%s: a grant whose wait for the standby was cancelled", p.name)

		renewKey := fmt.Sprintf("renew-%d", i+1)
		err = call(p, func(ctx context.Context) error {
			_, err := p.be.TryRenew(ctx, sqllock.Lease{Key: renewKey, Token: 7, Owner: "holder"}, 2*time.Hour)
			return err
		})
		t.Logf("%s: renewal: %v", p.name, err)
		require.ErrorIs(t, err, sqllock.ErrUnavailable, "%s: a renewal whose wait for the standby was cancelled", p.name)

		err = call(p, func(ctx context.Context) error {
			// A fenced transaction commits as its session says: this one
			// wants its write durable.
			return p.be.FencedTx(ctx, sqllock.Lease{Key: renewKey, Token: 7, Owner: "holder"}, func(tx pgx.Tx) error {
				_, err := tx.Exec(ctx, "SET LOCAL synchronous_commit = on")
				if err != nil {
					return err
				}
				_, err = tx.Exec(ctx, "CREATE TABLE fenced_"+strings.ReplaceAll(p.name, "-", "_")+" (x int)")
				return err
			})
		})
		t.Logf("%s: fenced commit: %v", p.name, err)
		require.ErrorIs(t, err, sqllock.ErrIndeterminate, "%s: a fenced commit whose wait for the standby was cancelled", p.name)
		summary = append(summary, p.name+"=indeterminate")
	}
	blindErr := call(pool{name: "blind", be: blind, byOperator: true}, func(ctx context.Context) error {
		_, err := blind.TryAcquire(ctx, sqllock.AcquireRequest{Key: "grant-blind", TTL: time.Hour, Owner: "me"})
		return err
	})
	require.NoError(t, blindErr, "control: without OnNotice, PostgreSQL's answer to a cancelled wait is a success")

	// Every grant committed on the old primary.
	var before int
	require.NoError(t, admin.QueryRow(ctx, "SELECT count(*) FROM sqllock_locks WHERE key LIKE 'grant-%' AND token = 1").Scan(&before))
	require.Equal(t, len(pools)+1, before, "the cancelled grants are committed locally")

	// Failover: the standby, which received none of them, takes over.
	require.NoError(t, cluster.primary.Stop(pgtest.StopImmediate))
	require.NoError(t, cluster.standby.Start())
	require.NoError(t, cluster.standby.Promote())
	np := restartPool(t, cluster.standby.URL, "syncwait-new-primary", 2)
	var after int
	require.NoError(t, np.QueryRow(ctx, "SELECT count(*) FROM sqllock_locks WHERE key LIKE 'grant-%'").Scan(&after))
	require.Zero(t, after, "the standby was stopped: it cannot have the cancelled grants")
	be, err := postgres.New(np, postgres.Options{})
	require.NoError(t, err)
	defer be.Close()
	reused := 0
	for _, p := range append(pools, pool{name: "blind"}) {
		l, err := be.TryAcquire(ctx, sqllock.AcquireRequest{Key: "grant-" + p.name, TTL: time.Minute, Owner: "other"})
		require.NoError(t, err)
		if l.Token == 1 {
			reused++ // the token the old primary had granted
		}
	}
	require.Equal(t, len(pools)+1, reused)
	t.Logf("RESULT test=TestPostgresCancelledSyncWaitIsIndeterminate %s operator_cancels=%d committed_on_old_primary=%d on_new_primary=0 tokens_granted_again=%d "+
		"blind_pool_reported=success (without postgres.OnNotice)",
		strings.Join(summary, " "), waits.Load(), before, reused)
}
