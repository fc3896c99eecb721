package sim_test

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ashlock/ashlock/internal/mutant"
	"github.com/ashlock/ashlock/internal/sim"
)

// TestSimCheckerSensitivity is SIM-3: each deliberately broken behaviour
// in internal/mutant must make some checker fail within the seed budget.
// It switches a global mutant, so it must not run in parallel with tests
// that expect correct behaviour: it is a sequential top-level test, and
// every other test in this package runs its parallel parts inside its own
// top-level test, so none overlaps it.
func TestSimCheckerSensitivity(t *testing.T) {
	budget := uint64(seedCount())
	f := newFigures()
	for _, k := range []mutant.Kind{mutant.DeadlineFromReply, mutant.RenewIgnoresToken, mutant.ReleaseDeletesRow, mutant.GuardIgnoresLoss} {
		restore := mutant.Set(k)
		// The smallest failing seed: shards run seeds in order and stop
		// once a smaller seed has failed.
		var first atomic.Uint64
		first.Store(budget)
		var mu sync.Mutex
		var checkers string
		t.Run(k.String(), func(t *testing.T) {
			for s := range shards {
				t.Run(fmt.Sprintf("shard=%d", s), func(t *testing.T) {
					t.Parallel()
					for seed := uint64(s); seed < budget && seed < first.Load(); seed += shards {
						res, rep, _, _, wall := runSeed(t, sim.Config{Seed: seed})
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
