package integration

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/faultproxy"
	"github.com/ashlock/ashlock/internal/testkit/history"
	"github.com/ashlock/ashlock/sqllock"
)

// chaosSeed is CHAOS_SEED, or a fresh seed (printed, for the replay).
func chaosSeed(t *testing.T) uint64 {
	if s := os.Getenv("CHAOS_SEED"); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		require.NoError(t, err, "CHAOS_SEED")
		return n
	}
	return uint64(time.Now().UnixNano())
}

// chaosDuration is 30s (the default tier), ROBUST_CHAOS_DURATION when
// set, or 5 minutes with SQLLOCK_LONG=1.
func chaosDuration(t *testing.T) time.Duration {
	if s := os.Getenv("ROBUST_CHAOS_DURATION"); s != "" {
		d, err := time.ParseDuration(s)
		require.NoError(t, err, "ROBUST_CHAOS_DURATION")
		return d
	}
	if os.Getenv("SQLLOCK_LONG") == "1" {
		return 5 * time.Minute
	}
	return 30 * time.Second
}

// TestRobustChaosHistory is HIST-PG: for 30s, 6 clients, each behind its own proxy,
// take 3 keys and increment fenced counters (a quarter of the sessions
// carelessly: they write without looking at their guard after their work,
// so a fault that ends the guard meanwhile makes a zombie write), while a
// seeded schedule
// injects one fault at a time: a blackhole of TTL/2–3TTL/2, hold-then-deliver
// of TTL/4–3TTL/4, latency of TTL/20–TTL/4 for one TTL, a reset, a row-lock
// stall of TTL/2–3TTL/2 (with robustTTL: 2–6s, 1–3s, 200ms–1s for 4s, 2–6s;
// the schedule written for a 2s TTL, scaled, so that faults outlast a local
// deadline as often as they did). The history and the database's audit log
// are checked by every checker and by porcupine.
// It runs alone (not in parallel), so that the machine's load does not eat
// the margin.
func TestRobustChaosHistory(t *testing.T) {
	const clients = 6
	keys := []string{"c0", "c1", "c2"}
	seed, duration := chaosSeed(t), chaosDuration(t)
	replay := fmt.Sprintf("CHAOS_SEED=%d ROBUST_CHAOS_DURATION=%v go test ./integration -run '^TestRobustChaosHistory$' -v", seed, duration)
	t.Logf("chaos seed %d, %v; replay: %s", seed, duration, replay)
	params := robustParams
	w := newRobustWorld(t, "HIST-PG", seed, robustTTL, params)
	// scale turns a fault duration written for a TTL of 2s into the same
	// fraction of this world's TTL.
	scale := func(d time.Duration) time.Duration { return d * (w.ttl / time.Millisecond) / 2000 }
	ctx, cancel := context.WithTimeout(t.Context(), duration+60*time.Second)
	defer cancel()
	var cs []*robustClient
	for range clients {
		cs = append(cs, w.client(true, robustOpts()))
	}

	runCtx, stop := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for i, pc := range cs {
		rng := rand.New(rand.NewPCG(seed, uint64(i)+1))
		wg.Go(func() {
			for runCtx.Err() == nil {
				key := keys[rng.IntN(len(keys))]
				g, gid, err := w.hold(runCtx, pc, key, 2*w.ttl, false)
				if err != nil {
					continue
				}
				// One session in four is careless: it writes after its
				// work without looking at its guard (a zombie when the
				// guard ended meanwhile).
				careless := rng.IntN(4) == 0
				for range 1 + rng.IntN(4) {
					if !w.rmw(pc, g, gid, key, time.Duration(100+rng.IntN(600))*time.Millisecond, careless) {
						break
					}
				}
				rctx, rcancel := context.WithTimeout(ctx, 2*time.Second)
				_ = g.Release(rctx)
				rcancel()
				pause(runCtx, time.Duration(rng.IntN(100))*time.Millisecond)
			}
		})
	}

	// The fault schedule: one fault at a time, every kind in turn (in a
	// seeded order), each on a seeded client or key.
	rng := rand.New(rand.NewPCG(seed, 0))
	kinds := []string{"blackhole", "hold", "latency", "reset", "row_lock_stall"}
	faults := map[string]int{}
	for _, k := range kinds {
		faults[k] = 0
	}
	var schedule []string
	end := time.Now().Add(duration)
	for round := 0; time.Now().Before(end); round++ {
		if round%len(kinds) == 0 {
			rng.Shuffle(len(kinds), func(i, j int) { kinds[i], kinds[j] = kinds[j], kinds[i] })
		}
		kind := kinds[round%len(kinds)]
		pc := cs[rng.IntN(len(cs))]
		key := keys[rng.IntN(len(keys))]
		d := scale(time.Duration(1000+rng.IntN(2000)) * time.Millisecond)
		at := time.Duration(w.rec.Now()).Round(time.Millisecond)
		switch kind {
		case "blackhole":
			schedule = append(schedule, fmt.Sprintf("%v blackhole c%d %v", at, pc.id, d))
			pc.proxy.Set(faultproxy.Blackhole)
			pause(ctx, d)
			pc.proxy.Pass()
		case "hold":
			d = d / 2
			schedule = append(schedule, fmt.Sprintf("%v hold c%d %v", at, pc.id, d))
			pc.proxy.Set(faultproxy.Hold)
			pause(ctx, d)
			pc.proxy.Pass()
		case "latency":
			l := scale(time.Duration(100+rng.IntN(400)) * time.Millisecond)
			schedule = append(schedule, fmt.Sprintf("%v latency c%d %v for %v", at, pc.id, l, w.ttl))
			pc.proxy.SetLatency(l, l/5)
			pause(ctx, w.ttl)
			pc.proxy.Pass()
		case "reset":
			schedule = append(schedule, fmt.Sprintf("%v reset c%d", at, pc.id))
			pc.proxy.Reset()
		case "row_lock_stall":
			schedule = append(schedule, fmt.Sprintf("%v row-lock stall %s %v", at, key, d))
			tx, err := w.db.Pool.Begin(ctx)
			require.NoError(t, err)
			_, err = tx.Exec(ctx, "SELECT 1 FROM sqllock_locks WHERE key = $1 FOR UPDATE", key)
			require.NoError(t, err)
			pause(ctx, d)
			require.NoError(t, tx.Commit(ctx))
		}
		faults[kind]++
		pause(ctx, time.Duration(300+rng.IntN(500))*time.Millisecond)
	}
	stop()
	wg.Wait()
	t.Logf("fault schedule (seed %d):\n%s", seed, strings.Join(schedule, "\n"))

	h, r := w.check(ctx, replay)
	require.Equal(t, "Ok", r.Lin, "porcupine")
	grants := 0
	for _, a := range h.Audit {
		if a.Kind == history.Acquire {
			grants++
		}
	}
	require.Positive(t, r.AcceptedWrites)
	t.Log(w.figures("TestRobustChaosHistory", h, r, faults,
		fmt.Sprintf("clients=%d keys=%d duration=%v seed=%d audit_rows=%d grants=%d", clients, len(keys), duration, seed, len(h.Audit), grants)))
	robustRequireFired(t, faults)
	_ = sqllock.ErrLeaseLost
}
