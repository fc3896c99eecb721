package sim_test

import (
	"os"
	"strconv"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/sim"
)

// multiSeeds is SIM-9's seed budget: fewer than SIM-1's, each seed runs
// several clients through 25 sessions of sets.
func multiSeeds() int {
	switch {
	case os.Getenv("SQLLOCK_LONG") == "1":
		return 5000
	case raceEnabled:
		return 20
	}
	return 200
}

func runMulti(t *testing.T, cfg sim.MultiConfig) (res *sim.MultiResult) {
	t.Helper()
	synctest.Test(t, func(t *testing.T) { res = sim.RunMulti(cfg) })
	return res
}

// TestSimMultiKey is SIM-9: clients take sets of keys under crashes,
// pauses, lost replies, failures before sending and delays. No acquire of
// a set may grant part of it at the database, and no key may have two
// holders at once; every fault kind must have been injected.
func TestSimMultiKey(t *testing.T) {
	start := time.Now()
	seeds := uint64(multiSeeds())
	first := uint64(0)
	if s := os.Getenv("SIM_SEED"); s != "" {
		n, err := strconv.ParseUint(s, 10, 64)
		require.NoError(t, err)
		first, seeds = n, n+1
	}
	faults := map[string]int{}
	var grants, refusals, failures int
	for seed := first; seed < seeds; seed++ {
		res := runMulti(t, sim.MultiConfig{Seed: seed})
		if res.Partial > 0 || res.Overlaps > 0 {
			t.Fatalf("SIM_SEED=%d: %d partial grants, %d two holders of a key: %q", seed, res.Partial, res.Overlaps, res.Examples)
		}
		grants, refusals, failures = grants+res.Grants, refusals+res.Refusals, failures+res.Failures
		for k, n := range res.Faults {
			faults[k] += n
		}
	}
	for _, k := range sim.MultiFaultKinds {
		require.Positive(t, faults[k], "fault %s never injected", k)
	}
	require.Positive(t, grants)
	require.Positive(t, refusals)
	t.Logf("SIM-9: %d seeds in %v: sets granted %d, refused %d, failed %d; faults %v; partial grants 0, two holders 0",
		seeds-first, time.Since(start).Round(time.Millisecond), grants, refusals, failures, faults)
}

// TestSimMultiKeySensitivity shows that SIM-9's two counts can fail: a
// database that grants part of a set is caught by the partial-grant
// count, one that grants a set over another holder by the two-holders
// count, each within a few seeds.
func TestSimMultiKeySensitivity(t *testing.T) {
	for _, c := range []struct {
		mutant string
		caught func(*sim.MultiResult) bool
	}{
		{sim.MutantPartialGrant, func(r *sim.MultiResult) bool { return r.Partial > 0 }},
		{sim.MutantGrantPastHolder, func(r *sim.MultiResult) bool { return r.Overlaps > 0 }},
	} {
		t.Run(c.mutant, func(t *testing.T) {
			const budget = 20
			for seed := range uint64(budget) {
				res := runMulti(t, sim.MultiConfig{Seed: seed, Mutant: c.mutant})
				if c.caught(res) {
					t.Logf("%s: caught at SIM_SEED=%d: %d partial grants, %d two holders: %q", c.mutant, seed, res.Partial, res.Overlaps, res.Examples)
					return
				}
			}
			t.Fatalf("%s: not caught within %d seeds", c.mutant, budget)
		})
	}
}
