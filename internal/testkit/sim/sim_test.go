package sim_test

import (
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/sim"
)

const shards = 4

// TestSim is SIM-1: seeds 0..N-1 of the random workload, every checker on
// every seed. SIM_SEED=n replays one seed.
func TestSim(t *testing.T) {
	f := newFigures()
	if seed, ok := seedFromEnv(t); ok {
		res, rep, model, info, wall := runSeed(t, sim.Config{Seed: seed})
		f.add(res, rep, wall)
		if rep.Anomalies() > 0 {
			failSeed(t, "TestSim", res, rep, model, info)
		}
		t.Log(f.line("TestSim"))
		return
	}
	n := seedCount()
	var failed atomic.Int32
	t.Run("seeds", func(t *testing.T) {
		for s := range shards {
			t.Run(fmt.Sprintf("shard=%d", s), func(t *testing.T) {
				t.Parallel()
				for seed := uint64(s); seed < uint64(n); seed += shards {
					if failed.Load() > 3 {
						return // enough reports
					}
					res, rep, model, info, wall := runSeed(t, sim.Config{Seed: seed})
					f.add(res, rep, wall)
					if rep.Anomalies() > 0 {
						failed.Add(1)
						failSeed(t, "TestSim", res, rep, model, info)
					}
				}
			})
		}
	})
	t.Log(f.line("TestSim"))
	f.requireConfiguredFired(t)
	require.Zero(t, f.rep.StaleApplied)
}

// TestSimDeterminism is SIM-2: the same seed twice gives the same history
// (20 seeds; 4 under -race, where a seed of the many-leases scenario takes
// seconds and the 20 were the longest test of CI's race run: the 20 run
// without -race in CI's run of this package with the sqllock_mutants tag).
func TestSimDeterminism(t *testing.T) {
	f := newFigures()
	mismatches := 0
	n := 20
	if raceEnabled {
		n = 4
	}
	if v, err := strconv.Atoi(os.Getenv("SIM_DETERMINISM_SEEDS")); err == nil {
		n = v
	}
	for _, seed := range seedList(t, n) {
		var hashes [2]string
		// Odd seeds run the many-leases scenario (SIM-6), whose batches
		// must replay too.
		scenario := sim.Random
		if seed%2 == 1 {
			scenario = sim.Many
		}
		for i := range hashes {
			res, rep, model, info, wall := runSeed(t, sim.Config{Seed: seed, Scenario: scenario})
			f.add(res, rep, wall)
			if rep.Anomalies() > 0 {
				failSeed(t, "TestSimDeterminism", res, rep, model, info)
			}
			hashes[i] = res.History.Hash()
		}
		if hashes[0] != hashes[1] {
			mismatches++
			t.Errorf("SIM_SEED=%d: two runs gave different histories (%s, %s)", seed, hashes[0][:12], hashes[1][:12])
		}
	}
	f.extra = append(f.extra, fmt.Sprintf("determinism={seeds:%d, runs:2, mismatches:%d}", n, mismatches))
	t.Log(f.line("TestSimDeterminism"))
}
