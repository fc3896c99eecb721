package sim_test

import (
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/faultbackend"
	"github.com/ashlock/ashlock/internal/testkit/history"
	"github.com/ashlock/ashlock/internal/testkit/sim"
)

const scenarioSeeds = 50

// TestSimPause is SIM-4 (Kleppmann's scenario): the holder's whole process
// pauses for 1.5×TTL between its read and its write. The other client
// takes the key only after the database deadline (C-DBOVERLAP), the paused
// holder's late writes are refused by the fence once the new holder has
// read (C-FENCE, applied = 0), and its overlap with the new holder is
// reported as the documented paused-holder case, not as an anomaly.
func TestSimPause(t *testing.T) {
	f := newFigures()
	pausedOverlaps := 0
	for _, seed := range seedList(t, scenarioSeeds) {
		res, rep, model, info, wall := runSeed(t, sim.Config{Seed: seed, Scenario: sim.Paused})
		f.add(res, rep, wall)
		if rep.Anomalies() > 0 {
			failSeed(t, "TestSimPause", res, rep, model, info)
		}
		pausedOverlaps += rep.PausedOverlaps
	}
	t.Log(f.line("TestSimPause"))
	f.requireConfiguredFired(t)
	require.Positive(t, pausedOverlaps, "no paused holder ever overlapped the next holder: the scenario tested nothing")
	require.Positive(t, f.rep.ZombieRejected, "no write of a paused holder was refused")
	require.Zero(t, f.rep.StaleApplied)
}

// TestSimDBClockStep is SIM-5: the database clock steps forward by twice
// the margin while A holds, beyond assumption A2. The next holder may then
// start while A's guard is still valid: C-GUARD detects that overlap (it
// is an anomaly unless the run declares such steps), and the fence still
// applies no stale write.
func TestSimDBClockStep(t *testing.T) {
	f := newFigures()
	clockOverlaps, detected := 0, 0
	for _, seed := range seedList(t, scenarioSeeds) {
		res, rep, model, info, wall := runSeed(t, sim.Config{Seed: seed, Scenario: sim.ClockStep})
		f.add(res, rep, wall)
		if rep.Anomalies() > 0 {
			failSeed(t, "TestSimDBClockStep", res, rep, model, info)
		}
		clockOverlaps += rep.ClockOverlaps
		// Without the declaration the same history is an anomaly.
		h := *res.History
		h.Params.ClockStepsBeyondMargin = false
		strict := &history.Report{}
		history.CheckGuard(&h, strict)
		// An overlap that is no longer excused by the clock step is
		// reported.
		detected += strict.Count(history.CGuard)
	}
	f.extra = append(f.extra, fmt.Sprintf("guard_overlaps_if_undeclared=%d", detected))
	t.Log(f.line("TestSimDBClockStep"))
	f.requireConfiguredFired(t)
	require.Positive(t, clockOverlaps, "the clock step never made two guards overlap: the scenario tested nothing")
	require.Equal(t, clockOverlaps, detected, "C-GUARD must report every clock-step overlap when steps are not declared")
	require.Zero(t, f.rep.StaleApplied)
}

// batchFigures counts, in one history, what SIM-6 is about: batch
// renewals (renew operations of one client called at one instant), those
// with more than one lease, with mixed outcomes, with one key twice, and
// releases sent while a renewal of their lease was in flight.
type batchFigures struct {
	batches, multi, mixed, keyTwice, racingReleases int
	lostReplies, hung                               int // multi-lease batches whose reply was lost, that hung
}

func countBatches(h *history.History) batchFigures {
	type id struct {
		client int
		call   int64
	}
	groups := map[id][]history.Op{}
	var order []id
	for _, op := range h.Ops {
		if op.Kind != history.Renew {
			continue
		}
		k := id{op.Client, op.Call}
		if groups[k] == nil {
			order = append(order, k)
		}
		groups[k] = append(groups[k], op)
	}
	var f batchFigures
	for _, k := range order {
		ops := groups[k]
		f.batches++
		if len(ops) < 2 {
			continue
		}
		f.multi++
		outcomes := map[history.Outcome]bool{}
		keys := map[string]bool{}
		twice := false
		for _, op := range ops {
			outcomes[op.Outcome] = true
			twice = twice || keys[op.Key]
			keys[op.Key] = true
		}
		if len(outcomes) > 1 {
			f.mixed++
		}
		if twice {
			f.keyTwice++
		}
		switch ops[0].Fault {
		case "fail_after":
			f.lostReplies++
		case "hang":
			f.hung++
		}
	}
	for _, rel := range h.Ops {
		if rel.Kind != history.Release {
			continue
		}
		for _, op := range h.Ops {
			if op.Kind == history.Renew && op.Client == rel.Client && op.Key == rel.Key && op.Token == rel.Token &&
				op.Call <= rel.Call && rel.Call < op.Return {
				f.racingReleases++
				break
			}
		}
	}
	return f
}

// TestSimMany is SIM-6: client processes holding several leases at once,
// renewed in batches, under the per-call faults applied to whole batches
// (a lost batch reply leaves every lease in it unknown: each is settled by
// its own next renewal), hangs past some of its guards' local deadlines
// (those end on time, the others carry on), busy elements, expiries (mixed
// outcomes), and releases racing a batch in flight.
func TestSimMany(t *testing.T) {
	f := newFigures()
	var total batchFigures
	var mu sync.Mutex
	n := seedCount()
	if _, ok := seedFromEnv(t); ok {
		n = 1
	}
	var failed atomic.Int32
	shardSeeds(t, n, func(t *testing.T, seed uint64) bool {
		if failed.Load() > 3 {
			return false
		}
		res, rep, model, info, wall := runSeed(t, sim.Config{Seed: seed, Scenario: sim.Many})
		f.add(res, rep, wall)
		bf := countBatches(res.History)
		mu.Lock()
		total.batches += bf.batches
		total.multi += bf.multi
		total.mixed += bf.mixed
		total.keyTwice += bf.keyTwice
		total.racingReleases += bf.racingReleases
		total.lostReplies += bf.lostReplies
		total.hung += bf.hung
		mu.Unlock()
		if rep.Anomalies() > 0 {
			failed.Add(1)
			failSeed(t, "TestSimMany", res, rep, model, info)
		}
		return true
	})
	f.extra = append(f.extra, fmt.Sprintf("batches={renewals:%d, multi_lease:%d, mixed_outcomes:%d, key_twice:%d, reply_lost:%d, hung:%d} releases_racing_a_batch=%d",
		total.batches, total.multi, total.mixed, total.keyTwice, total.lostReplies, total.hung, total.racingReleases))
	t.Log(f.line("TestSimMany"))
	f.requireConfiguredFired(t)
	require.Zero(t, f.rep.StaleApplied)
	if n > 1 {
		require.Positive(t, total.multi, "no batch carried more than one lease: the scenario tested nothing")
		require.Positive(t, total.mixed, "no batch had mixed outcomes")
		require.Positive(t, total.racingReleases, "no release raced a batch in flight")
		require.Positive(t, total.lostReplies, "no multi-lease batch lost its reply")
		require.Positive(t, total.hung, "no multi-lease batch hung")
	}
}

// shardSeeds runs each of the seeds 0..n-1 (or SIM_SEED alone) through
// run, in shards that run in parallel, each seed in order within its
// shard; a shard stops when run returns false.
func shardSeeds(t *testing.T, n int, run func(t *testing.T, seed uint64) bool) {
	t.Run("seeds", func(t *testing.T) {
		for s := range shards {
			t.Run(fmt.Sprintf("shard=%d", s), func(t *testing.T) {
				t.Parallel()
				for _, seed := range seedList(t, n) {
					if seed%shards != uint64(s) && n > 1 {
						continue
					}
					if !run(t, seed) {
						return
					}
				}
			})
		}
	})
}

// lostGuards counts the guards of h that ended lost, by cause.
func lostGuards(h *history.History) (n int, first string) {
	for _, g := range h.Guards {
		if strings.HasPrefix(g.Cause, "lost") {
			if n == 0 {
				first = fmt.Sprintf("guard of client %d on %q, token %d: %s", g.Client, g.Key, g.Token, g.Cause)
			}
			n++
		}
	}
	return n, first
}

// runStuck runs n seeds of SIM-7 and returns the figures, the lost guards
// in all, and the first seed that lost one (with why).
func runStuck(t *testing.T, n int) (f *figures, hung, lost int, firstLost string) {
	f = newFigures()
	var mu sync.Mutex
	firstSeed := uint64(1<<64 - 1)
	shardSeeds(t, n, func(t *testing.T, seed uint64) bool {
		res, rep, model, info, wall := runSeed(t, sim.Config{Seed: seed, Scenario: sim.Stuck})
		f.add(res, rep, wall)
		if rep.Anomalies() > 0 {
			failSeed(t, "TestSimStuckCalls", res, rep, model, info)
		}
		l, why := lostGuards(res.History)
		mu.Lock()
		hung += int(res.Counts[faultbackend.Hang])
		lost += l
		if l > 0 && seed < firstSeed {
			firstSeed, firstLost = seed, fmt.Sprintf("SIM_SEED=%d: %s", seed, why)
		}
		mu.Unlock()
		return true
	})
	return f, hung, lost, firstLost
}

// TestSimStuckCalls is SIM-7: calls that never return (a half-open
// connection) while later calls are answered. Each renewal attempt is
// bounded well inside the lease and retried, so no lease is ever lost,
// and nothing else breaks (anomalies 0). Its sensitivity (renewals
// bounded only by the local deadline lose leases here) is shown in
// TestSimStuckCallsSensitivity.
func TestSimStuckCalls(t *testing.T) {
	n := seedCount()
	if _, ok := seedFromEnv(t); ok {
		n = 1
	}
	f, hung, lost, first := runStuck(t, n)
	f.extra = append(f.extra, fmt.Sprintf("hung_calls=%d lost_guards=%d", hung, lost))
	t.Log(f.line("TestSimStuckCalls"))
	f.requireConfiguredFired(t)
	require.Zero(t, f.rep.StaleApplied)
	require.Zero(t, lost, "a lease was lost although the backend answered every call but the hung ones; first: %s", first)
	if n > 1 {
		require.Positive(t, hung, "no call hung: the scenario tested nothing")
	}
}
