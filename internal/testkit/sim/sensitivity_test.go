//go:build sqllock_mutants

package sim_test

import (
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ashlock/ashlock/internal/testkit/sim"
	"github.com/ashlock/ashlock/sqllock"
)

// TestSimCheckerSensitivity is SIM-3: each deliberately broken behaviour
// must make some checker fail within the seed budget. Three are the client's
// (compiled into sqllock only with the sqllock_mutants build tag, which this
// file needs: go test -tags sqllock_mutants ./internal/testkit/sim), two the
// database's (sim.BackendMutants, a wrapper of the memory backend). A client
// mutant is global, so this test must not run in parallel with tests that
// expect correct behaviour: it is a sequential top-level test, and every
// other test in this package runs its parallel parts inside its own
// top-level test, so none overlaps it.
func TestSimCheckerSensitivity(t *testing.T) {
	budget := uint64(seedCount())
	f := newFigures()
	for _, k := range []string{"deadline-from-reply", sim.MutantRenewIgnoresToken, sim.MutantReleaseDeletesRow, "guard-ignores-loss", "batch-deadline-from-reply"} {
		var cfg sim.Config
		if k == "batch-deadline-from-reply" {
			cfg.Scenario = sim.Many // batches of many leases
		}
		restore := func() {}
		if slices.Contains(sim.BackendMutants, k) {
			cfg.Mutant = k
		} else {
			var ok bool
			restore, ok = sqllock.SetMutant(k)
			if !ok {
				t.Fatalf("sqllock has no client mutant %q", k)
			}
		}
		// The smallest failing seed: shards run seeds in order and stop
		// once a smaller seed has failed.
		var first atomic.Uint64
		first.Store(budget)
		var mu sync.Mutex
		var checkers string
		t.Run(k, func(t *testing.T) {
			for s := range shards {
				t.Run(fmt.Sprintf("shard=%d", s), func(t *testing.T) {
					t.Parallel()
					for seed := uint64(s); seed < budget && seed < first.Load(); seed += shards {
						cfg := cfg
						cfg.Seed = seed
						res, rep, _, _, wall := runSeed(t, cfg)
						f.add(res, rep, wall)
						if rep.Anomalies() == 0 {
							continue
						}
						mu.Lock()
						if seed < first.Load() {
							first.Store(seed)
							checkers = rep.Checkers() + ": " + rep.First()
						}
						mu.Unlock()
						return
					}
				})
			}
		})
		restore()
		caught := first.Load() < budget
		f.extra = append(f.extra, fmt.Sprintf("%s={caught:%v, seeds_to_first_failure:%d, checkers:%s}", k, caught, first.Load()+1, firstWord(checkers)))
		if !caught {
			t.Errorf("mutant %s was not caught by any checker within %d seeds", k, budget)
			continue
		}
		t.Logf("mutant %s caught at SIM_SEED=%d (%d seeds): %s", k, first.Load(), first.Load()+1, checkers)
	}
	t.Log(f.line("TestSimCheckerSensitivity"))
	f.requireConfiguredFired(t)
}

func firstWord(s string) string {
	for i, c := range s {
		if c == ':' {
			return s[:i]
		}
	}
	return s
}

// TestSimStuckCallsSensitivity shows that SIM-7 can fail: with renewal
// attempts bounded only by the latest local deadline of their leases (the
// client's renew-unbounded mutant, as before attempts were bounded), a
// hung renewal costs its leases, and the scenario finds lost guards.
func TestSimStuckCallsSensitivity(t *testing.T) {
	restore, ok := sqllock.SetMutant("renew-unbounded")
	if !ok {
		t.Fatal("sqllock has no client mutant renew-unbounded")
	}
	defer restore()
	_, _, lost, first := runStuck(t, min(seedCount(), 100))
	if lost == 0 {
		t.Fatal("renewals bounded only by the local deadline lost no lease in SIM-7: the scenario cannot fail")
	}
	t.Logf("renew-unbounded: %d guards lost; first %s", lost, first)
}
