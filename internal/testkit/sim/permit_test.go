package sim_test

import (
	"fmt"
	"testing"
	"testing/synctest"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/history"
	"github.com/ashlock/ashlock/internal/testkit/sim"
)

// permitSeeds is how many seeds each semaphore run takes: a tenth of
// SIM-1's.
func permitSeeds() int { return max(seedCount()/10, 10) }

// runPermitSeed runs one seed of the semaphore simulation and checks it
// with every checker but C-LIN (whose model is one lock per key, while a
// refused permit acquire names the semaphore and a grant its permit).
func runPermitSeed(t *testing.T, cfg sim.Config) (*sim.Result, *history.Report) {
	t.Helper()
	var res *sim.Result
	synctest.Test(t, func(t *testing.T) { res = sim.Run(cfg) })
	return res, history.Check(res.History)
}

// TestSimPermits: the random workload (crashes, pauses, lost replies,
// delays, hangs, clock jumps, expiries) on semaphores of 1, 2 and 3
// permits: no semaphore ever has more holders than permits by the
// database clock (C-PERMITS), and every single-key checker holds per
// permit (tokens, fencing, guards, lost updates). SIM_SEED=n replays one
// seed.
func TestSimPermits(t *testing.T) {
	for _, n := range []int{1, 2, 3} {
		t.Run(fmt.Sprintf("permits=%d", n), func(t *testing.T) {
			t.Parallel()
			granted := 0
			for _, seed := range seedList(t, permitSeeds()) {
				res, rep := runPermitSeed(t, sim.Config{Seed: seed, Permits: n})
				for _, op := range res.History.Ops {
					if op.Kind == history.Acquire && op.Outcome == history.OK {
						granted++
					}
				}
				if rep.Anomalies() > 0 {
					t.Fatalf("SIM_SEED=%d permits=%d: %d anomalies (%s); first: %s", seed, n, rep.Anomalies(), rep.Checkers(), rep.First())
				}
			}
			require.Positive(t, granted, "no permit was ever granted")
		})
	}
}

// TestSimPermitsCheckerSensitivity: with the backend keeping one permit
// more than asked, C-PERMITS reports more holders than the limit within
// the seed budget.
func TestSimPermitsCheckerSensitivity(t *testing.T) {
	for _, n := range []int{1, 3} {
		t.Run(fmt.Sprintf("permits=%d", n), func(t *testing.T) {
			t.Parallel()
			for seed := range uint64(permitSeeds()) {
				_, rep := runPermitSeed(t, sim.Config{Seed: seed, Permits: n, Mutant: sim.MutantPermitsPlusOne})
				if rep.Count(history.CPermits) > 0 {
					t.Logf("permits=%d: seed %d: %s", n, seed, rep.First())
					return
				}
			}
			t.Fatalf("permits=%d: %d permits granted at once in no seed of %d", n, n+1, permitSeeds())
		})
	}
}
