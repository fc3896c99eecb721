package integration

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/dialect/postgres"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// TestPostgresFailoverClockAhead: after a failover, the new primary's
// clock judges the deadlines the old primary wrote. If it runs ahead by d,
// a lease ends d early in real time, so a new holder can be granted the key
// up to d before the old lease's end; the old holder's guard ends at its
// local deadline, the margin before the old lease's end. The guard
// therefore ends before the new grant only while the margin exceeds the
// skew between the database hosts.
//
// The standby's clock runs 2s ahead (a clock_timestamp() in a schema that
// the clients' search_path puts before pg_catalog adds the standby's
// setting sqllock_test.clock_offset, which the primary lacks). Two holders
// on the primary, each with a pool that reaches only the primary (so they
// cannot renew after the failover), hold a key each with an 8s TTL: one
// with a 3s margin, one with a 1s margin. Their waiters reach whichever
// server accepts writes. The primary is killed and the standby promoted.
// With the 3s margin the old guard ends before the new grant; with the 1s
// margin the new holder is granted the key while the old guard still runs.
func TestPostgresFailoverClockAhead(t *testing.T) {
	t.Parallel()
	const (
		ttl  = 8 * time.Second
		skew = 2 * time.Second
	)
	cluster := newHACluster(t, true, map[string]string{"sqllock_test.clock_offset": skew.String()})
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	admin := restartPool(t, cluster.primary.URL, "skew-admin", 2)
	sqlDB := stdlib.OpenDBFromPool(admin)
	require.NoError(t, migrations.Up(ctx, migrations.Postgres, sqlDB, migrations.Options{}))
	require.NoError(t, sqlDB.Close())
	_, err := admin.Exec(ctx, `CREATE SCHEMA skew`)
	require.NoError(t, err)
	_, err = admin.Exec(ctx, `CREATE FUNCTION skew.clock_timestamp() RETURNS timestamptz LANGUAGE sql VOLATILE
AS $$ SELECT pg_catalog.clock_timestamp()
             + coalesce(nullif(current_setting('sqllock_test.clock_offset', true), ''), '0')::interval $$`)
	require.NoError(t, err)
	require.NoError(t, cluster.primary.WaitStreaming(ctx, standbyName, "sync"))

	client := func(url, name string, opts sqllock.Options) *sqllock.Client {
		cfg, err := pgxpool.ParseConfig(url)
		require.NoError(t, err)
		cfg.MaxConns = 2
		cfg.ConnConfig.ConnectTimeout = time.Second
		cfg.ConnConfig.RuntimeParams["search_path"] = "public,skew,pg_catalog"
		cfg.ConnConfig.RuntimeParams["application_name"] = "skew-" + name
		pool, err := pgxpool.NewWithConfig(ctx, cfg)
		require.NoError(t, err)
		t.Cleanup(pool.Close)
		be, err := postgres.New(pool, postgres.Options{})
		require.NoError(t, err)
		opts.Owner, opts.TTL = name, ttl
		c, err := sqllock.New(be, opts)
		require.NoError(t, err)
		t.Cleanup(func() {
			cctx, ccancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer ccancel()
			_ = c.Close(cctx)
			require.NoError(t, be.Close())
		})
		return c
	}
	type side struct {
		name     string
		margin   time.Duration
		holder   *sqllock.Guard
		ended    chan time.Time
		granted  chan *sqllock.Guard
		waitErr  chan error
		waiterAt time.Time // the new grant, in real time
		endAt    time.Time
	}
	sides := []*side{{name: "safe", margin: 3 * time.Second}, {name: "unsafe", margin: time.Second}}
	for _, s := range sides {
		h := client(cluster.primary.URL, "holder-"+s.name, sqllock.Options{Margin: s.margin, RenewInterval: 500 * time.Millisecond})
		s.holder, err = h.TryAcquire(ctx, "skew-"+s.name, nil)
		require.NoError(t, err)
		s.ended, s.granted, s.waitErr = make(chan time.Time, 1), make(chan *sqllock.Guard, 1), make(chan error, 1)
		go func() {
			<-s.holder.Done()
			s.ended <- time.Now()
		}()
		w := client(cluster.url, "waiter-"+s.name, sqllock.Options{Backoff: robustBackoff})
		go func() {
			g, err := w.Acquire(ctx, "skew-"+s.name, &sqllock.AcquireOptions{Wait: time.Minute})
			if err != nil {
				s.waitErr <- err
				return
			}
			s.granted <- g
		}()
	}
	// Let both holders renew once, then fail over.
	pause(ctx, 700*time.Millisecond)
	_, promote := cluster.failover(t, 0)
	for _, s := range sides {
		select {
		case s.endAt = <-s.ended:
		case <-time.After(ttl + 5*time.Second):
			t.Fatalf("%s: the old holder's guard did not end", s.name)
		}
		var g *sqllock.Guard
		select {
		case g = <-s.granted:
		case err := <-s.waitErr:
			t.Fatalf("%s: waiter: %v", s.name, err)
		case <-time.After(ttl + 10*time.Second):
			t.Fatalf("%s: the waiter was not granted the key", s.name)
		}
		require.Greater(t, g.Token(), s.holder.Token())
		// The new primary reports its own clock: the grant happened skew
		// earlier in real time (both servers run on this host).
		s.waiterAt = g.Lease().BackendTime.Add(-skew)
		local := s.holder.LocalDeadline()
		require.False(t, s.endAt.After(local.Add(cancelSlack)), "%s: the guard ended %v after its local deadline", s.name, s.endAt.Sub(local))
	}
	safe, unsafe := sides[0], sides[1]
	// The old guard's end against the new grant, in real time: with the
	// margin above the skew the guard ends first (at its local deadline at
	// the latest); with the margin below it the two overlap.
	safeGap := safe.waiterAt.Sub(safe.holder.LocalDeadline())
	unsafeOverlap := unsafe.holder.LocalDeadline().Sub(unsafe.waiterAt)
	line := fmt.Sprintf("RESULT test=TestPostgresFailoverClockAhead ttl=%v new_primary_clock_ahead=%v promote_took=%v "+
		"margin_%v={old_guard_local_deadline_before_new_grant_by:%v, observed_end_before_new_grant_by:%v} "+
		"margin_%v={overlap_of_old_guard_and_new_grant:%v}",
		ttl, skew, promote.Round(time.Millisecond),
		safe.margin, safeGap.Round(time.Millisecond), safe.waiterAt.Sub(safe.endAt).Round(time.Millisecond),
		unsafe.margin, unsafeOverlap.Round(time.Millisecond))
	t.Log(line)
	require.Positive(t, safeGap, "margin %v > skew %v: the old guard must end before the new grant", safe.margin, skew)
	require.Positive(t, safe.waiterAt.Sub(safe.endAt), "observed: the old guard ended after the new grant")
	require.Positive(t, unsafeOverlap, "margin %v < skew %v: the control must show the overlap, or the skew is not in effect", unsafe.margin, skew)
}
