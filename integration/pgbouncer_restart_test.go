package integration

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/dialect/postgres"
	"github.com/ashlock/ashlock/internal/testkit/history"
	"github.com/ashlock/ashlock/internal/testkit/pgtest"
	"github.com/ashlock/ashlock/sqllock"
)

// TestPgBouncerRestart: four holders renew their leases through PgBouncer
// in transaction mode (with the settings docs/pgbouncer.md documents), and two
// waiters wait for two of the keys, while PgBouncer is disturbed in turn:
// RECONNECT (every server connection closed once released), PAUSE for 1s
// then RESUME (statements queue), kill -9 and a restart 1s later (every
// client connection broken), and kill -9 with a restart 4s later (longer
// than the guards' 2.8s between the send of a renewal and the local
// deadline). Through the first three every guard renews; through the last
// every guard ends, no later than its local deadline, and the waiters then
// get their keys. No call hangs: each returns within 5s. The history and
// the database's audit log are checked by every checker and porcupine.
func TestPgBouncerRestart(t *testing.T) {
	t.Parallel()
	bouncer := pgtest.NewPgBouncer(t, pgtest.PoolTransaction, nil)
	direct, err := pgxpool.New(t.Context(), bouncer.DirectURL)
	require.NoError(t, err)
	t.Cleanup(direct.Close)
	db := &pgtest.DB{Pool: direct, Schema: "public", URL: bouncer.URL + "&default_query_exec_mode=exec", AdminURL: bouncer.DirectURL}
	w := newRobustWorldOn(t, db, "PGBOUNCER-RESTART", 0, robustTTL, robustParams)
	w.beOpts = postgres.Options{DisableNotify: true}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()

	const holders = 4
	type held struct {
		pc  *robustClient
		g   *sqllock.Guard
		key string
	}
	var hs []held
	for i := range holders {
		pc := w.client(false, robustOpts())
		key := fmt.Sprint("b", i)
		g, _, err := w.hold(ctx, pc, key, 0, true)
		require.NoError(t, err)
		hs = append(hs, held{pc, g, key})
	}
	type waited struct {
		g   *sqllock.Guard
		err error
	}
	waits := make(chan waited, 2)
	var wg sync.WaitGroup
	for i := range 2 {
		pc := w.client(false, robustOpts())
		wg.Go(func() {
			g, _, err := w.hold(ctx, pc, hs[i].key, time.Minute, false)
			waits <- waited{g, err}
		})
	}

	// Every call through the backends is timed by the recorder: none may
	// take longer than this.
	const hangBound = 5 * time.Second
	alive := func() int {
		n := 0
		for _, h := range hs {
			if h.g.Err() == nil {
				n++
			}
		}
		return n
	}
	var phases []string
	phase := func(name string, disturb func()) {
		pause(ctx, 1500*time.Millisecond) // a few renewals in between
		before := alive()
		disturb()
		pause(ctx, 1500*time.Millisecond) // renewals after it
		phases = append(phases, fmt.Sprintf("%s:%d/%d", name, alive(), before))
	}
	admin := func(cmd string) {
		_, err := bouncer.Admin(ctx, cmd)
		require.NoError(t, err, cmd)
	}
	phase("reconnect", func() { admin("RECONNECT") })
	phase("pause_1s_resume", func() {
		admin("PAUSE")
		pause(ctx, time.Second)
		admin("RESUME")
	})
	phase("kill9_restart_after_1s", func() {
		bouncer.Kill()
		pause(ctx, time.Second)
		require.NoError(t, bouncer.Start())
	})
	require.Equal(t, holders, alive(), "a guard was lost to a short disturbance: %s", strings.Join(phases, " "))
	phase("kill9_restart_after_4s", func() {
		bouncer.Kill()
		pause(ctx, 4*time.Second)
		require.NoError(t, bouncer.Start())
	})
	for _, h := range hs {
		select {
		case <-h.g.Done():
		default:
			t.Fatalf("guard %s survived 4s without PgBouncer (local deadline %v)", h.key, h.g.LocalDeadline())
		}
		require.ErrorIs(t, h.g.Err(), sqllock.ErrLeaseLost)
	}
	for range 2 {
		select {
		case r := <-waits:
			require.NoError(t, r.err)
			require.NoError(t, r.g.Release(ctx))
		case <-time.After(20 * time.Second):
			t.Fatal("a waiter did not get its key within 20s of the restart")
		}
	}
	wg.Wait()
	for _, h := range hs {
		_ = h.g.Release(ctx) // reports the loss
	}

	h, r := w.check(ctx, "go test ./integration -run '^TestPgBouncerRestart$' -v")
	require.Equal(t, "Ok", r.Lin, "porcupine")
	slowest, slowestOp := time.Duration(0), ""
	renewOK, renewFailed := 0, 0
	for _, op := range h.Ops {
		if op.Return == 1<<63-1 {
			t.Fatalf("op %d (%s %s) never returned", op.ID, op.Kind, op.Key)
		}
		if d := time.Duration(op.Return - op.Call); d > slowest {
			slowest, slowestOp = d, fmt.Sprintf("%s %s: %s", op.Kind, op.Key, op.Outcome)
		}
		if op.Kind == history.Renew {
			if op.Outcome == history.OK {
				renewOK++
			} else {
				renewFailed++
			}
		}
	}
	require.LessOrEqual(t, slowest, hangBound, "a call hung: %s", slowestOp)
	require.Positive(t, renewFailed, "no renewal met a disturbance")
	t.Log(w.figures("TestPgBouncerRestart", h, r, map[string]int{"reconnect": 1, "pause": 1, "kill9": 2},
		fmt.Sprintf("pgbouncer=%q pool_mode=transaction guards=%d alive_after={%s} renewals={ok:%d, failed:%d} slowest_call=%v (%s) waiters_granted=2",
			bouncer.Version(), holders, strings.Join(phases, " "), renewOK, renewFailed, slowest.Round(time.Millisecond), slowestOp)))
	require.Zero(t, r.Anomalies())
}
