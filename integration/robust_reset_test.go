package integration

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/history"
)

// TestRobustConnectionReset is PG-1d: the holder A's connections are reset
// once a second, five times, while it renews and writes and B contends.
// The pool reconnects and renewals succeed after every reset; the guard
// survives, or ends by its local deadline (C-GUARD); no connection or
// session is left behind.
func TestRobustConnectionReset(t *testing.T) {
	t.Parallel()
	const key = "pg1d"
	w := newRobustWorld(t, "PG-1d", 0, robustTTL, robustParams)
	ctx, cancel := context.WithTimeout(t.Context(), 40*time.Second)
	defer cancel()
	a, b := w.client(true, robustOpts()), w.client(false, robustOpts())

	ga, gidA, err := w.hold(ctx, a, key, 0, true)
	require.NoError(t, err)
	var wg sync.WaitGroup
	runCtx, stop := context.WithCancel(ctx)
	wg.Go(func() {
		for runCtx.Err() == nil && ga.Err() == nil {
			w.rmw(a, ga, gidA, key, 0, false)
			pause(runCtx, 100*time.Millisecond)
		}
	})
	wg.Go(func() { // B contends
		for runCtx.Err() == nil {
			if g, gid, err := w.hold(runCtx, b, key, 0, true); err == nil {
				w.rmw(b, g, gid, key, 0, false)
				_ = g.Release(ctx)
			}
			pause(runCtx, 100*time.Millisecond)
		}
	})
	var resetAt []int64
	for range 5 {
		pause(ctx, time.Second)
		resetAt = append(resetAt, w.rec.Now())
		a.proxy.Reset()
	}
	pause(ctx, time.Second)
	stop()
	wg.Wait()
	survived := ga.Err() == nil
	_ = ga.Release(ctx)
	robustEventually(t, 20*time.Second, func() bool {
		var n int
		err := w.db.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", a.app).Scan(&n)
		return err == nil && n <= int(a.pool.Stat().TotalConns())
	}, "A's sessions at the server outnumber its pool's connections")

	h, r := w.check(ctx, "go test ./integration -run '^TestRobustConnectionReset$' -v")
	// After each reset a renewal of A succeeded (the pool reconnected), as
	// long as the guard lived.
	gA := guardOf(h, gidA)
	reconnects := 0
	for _, at := range resetAt {
		if at >= gA.End {
			break
		}
		for _, op := range h.Ops {
			if op.Client == a.id && op.Kind == history.Renew && op.Outcome == history.OK && op.Call > at {
				reconnects++
				break
			}
		}
	}
	require.Positive(t, reconnects, "no renewal succeeded after a reset")
	faults := map[string]int{"reset": a.proxy.Stats().Resets}
	t.Log(w.figures("TestRobustConnectionReset", h, r, faults,
		fmt.Sprintf("reset_rounds=%d renewals_after_reset=%d guard_survived=%v proxy_conns=%d", len(resetAt), reconnects, survived, a.proxy.Stats().Accepted)))
	robustRequireFired(t, faults)
}
