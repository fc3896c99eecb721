package sim_test

import (
	"testing"
	"testing/synctest"

	"github.com/ashlock/ashlock/internal/testkit/sim"
)

// sharedSeeds is how many seeds a shared-lock run takes: a tenth of SIM-1's.
func sharedSeeds() int { return max(seedCount()/10, 5) }

func runShared(t *testing.T, cfg sim.SharedConfig) (*sim.SharedResult, []string) {
	t.Helper()
	var res *sim.SharedResult
	synctest.Test(t, func(t *testing.T) { res = sim.RunShared(cfg) })
	return res, sim.CheckShared(res, cfg.Starve)
}

// TestSimShared (SIM-SHARED): readers and writers on two keys, under
// crashes, pauses past the TTL and lost replies: never an exclusive holder
// beside another holder by the backend's clock (S-EXCL), and tokens in
// the order of shared locks (S-TOKEN). SIM_SEED=n replays one seed.
func TestSimShared(t *testing.T) {
	t.Parallel()
	var grants [2]int
	for _, seed := range seedList(t, sharedSeeds()) {
		res, bad := runShared(t, sim.SharedConfig{Seed: seed})
		if len(bad) > 0 {
			t.Fatalf("SIM_SEED=%d: %d violations; first: %s", seed, len(bad), bad[0])
		}
		grants[0] += res.Grants[0]
		grants[1] += res.Grants[1]
	}
	if grants[0] == 0 || grants[1] == 0 {
		t.Fatalf("grants: %d shared, %d exclusive: the workload does not mix them", grants[0], grants[1])
	}
	t.Logf("grants: %d shared, %d exclusive", grants[0], grants[1])
}

// TestSimSharedNoStarvation (S-STARVE): readers keep arriving on a key, so
// that one holds it at every instant; a writer that waits for it is
// granted within the readers' TTL and a poll, each time.
func TestSimSharedNoStarvation(t *testing.T) {
	t.Parallel()
	for _, seed := range seedList(t, 3) {
		res, bad := runShared(t, sim.SharedConfig{Seed: seed, Starve: true})
		if len(bad) > 0 {
			t.Fatalf("SIM_SEED=%d: %d violations; first: %s", seed, len(bad), bad[0])
		}
		if res.Grants[0] < 20 {
			t.Fatalf("SIM_SEED=%d: only %d reader grants: the readers do not keep arriving", seed, res.Grants[0])
		}
	}
}
