package sim_test

import (
	"testing"
	"testing/synctest"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/history"
	"github.com/ashlock/ashlock/internal/testkit/sim"
)

// TestSimReaps runs the random workload with reaps after its expiries
// (Config.Reap): keys are deleted and granted again among crashes, pauses,
// clock steps and renewals, and every checker but linearizability still
// sees nothing, C-TOKEN (no token regression across a reap) first of all.
// (The linearizability model has no reap: its key state would keep the
// row that the reap deleted, so it is not run here.)
func TestSimReaps(t *testing.T) {
	t.Parallel()
	reaped := 0
	for seed := range uint64(40) {
		var res *sim.Result
		synctest.Test(t, func(t *testing.T) { res = sim.Run(sim.Config{Seed: seed, Reap: true}) })
		rep := history.Check(res.History)
		if rep.Anomalies() > 0 {
			t.Fatalf("SIM_SEED=%d with reaps: %d anomalies (%s); first: %s", seed, rep.Anomalies(), rep.Checkers(), rep.First())
		}
		if res.Counts[sim.Expire] > 0 {
			reaped++
		}
	}
	require.Greater(t, reaped, 10, "too few seeds expired (and so reaped) a key")
}

// TestSimReapSensitivity: a reap that forgets the floor is caught by
// C-TOKEN within the same seeds.
func TestSimReapSensitivity(t *testing.T) {
	t.Parallel()
	for seed := range uint64(40) {
		var res *sim.Result
		synctest.Test(t, func(t *testing.T) {
			res = sim.Run(sim.Config{Seed: seed, Reap: true, Mutant: sim.MutantReapForgetsFloor})
		})
		rep := history.Check(res.History)
		if rep.Count(history.CToken) > 0 {
			t.Logf("seed %d: %s", seed, rep.First())
			return
		}
	}
	t.Fatal("no seed of 40 showed a token regression with a reap that forgets the floor")
}
