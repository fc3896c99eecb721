//go:build sqllock_mutants

package sim_test

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/ashlock/ashlock/election"
	"github.com/ashlock/ashlock/internal/testkit/sim"
	"github.com/ashlock/ashlock/sqllock"
)

// TestElectionSimCheckerSensitivity: each of the election's deliberately
// broken behaviours (compiled into package election only with the
// sqllock_mutants build tag), and the client's deadline-from-reply, must
// make the election checkers report anomalies within the seed budget, and
// the checker that names the broken promise must be among them. The mutants are global: this is a
// sequential top-level test, like TestSimCheckerSensitivity.
func TestElectionSimCheckerSensitivity(t *testing.T) {
	budget := uint64(seedCount())
	f := newElectFigures()
	for _, m := range []struct {
		name string
		set  func(string) (func(), bool)
		want string // the checker that must fire
	}{
		// The leader's function context ends only with Run's: the leader
		// runs past its local deadline and past its lease.
		{"lead-past-deadline", election.SetMutant, sim.EDeadline},
		// Run returns after a lost term instead of campaigning again.
		{"run-returns-on-loss", election.SetMutant, sim.ECampaign},
		// The client's guard counts its local deadline from the reply:
		// E-DEADLINE recomputes the deadline from the send times in the
		// history rather than trusting the guard's own.
		{"deadline-from-reply", sqllock.SetMutant, sim.EDeadline},
	} {
		restore, ok := m.set(m.name)
		if !ok {
			t.Fatalf("no mutant %q", m.name)
		}
		// The smallest seed where the wanted checker fires: shards run
		// seeds in order and stop once a smaller seed has.
		var first atomic.Uint64
		first.Store(budget)
		var mu sync.Mutex
		var found string
		t.Run(m.name, func(t *testing.T) {
			for s := range shards {
				t.Run(fmt.Sprintf("shard=%d", s), func(t *testing.T) {
					t.Parallel()
					for seed := uint64(s); seed < budget && seed < first.Load(); seed += shards {
						res, rep, wall := runElectSeed(t, sim.ElectConfig{Seed: seed})
						f.add(res, rep, wall)
						if rep.Count(m.want) == 0 {
							continue
						}
						mu.Lock()
						if seed < first.Load() {
							first.Store(seed)
							found = fmt.Sprintf("%d anomalies (%s); first %s: %s", rep.Anomalies(), rep.Checkers(), m.want, firstOf(rep, m.want))
						}
						mu.Unlock()
						return
					}
				})
			}
		})
		restore()
		caught := first.Load() < budget
		f.extra = append(f.extra, fmt.Sprintf("%s={caught:%v, seeds_to_first_failure:%d, checker:%s}", m.name, caught, first.Load()+1, m.want))
		if !caught {
			t.Errorf("mutant %s was not caught by %s within %d seeds", m.name, m.want, budget)
			continue
		}
		t.Logf("mutant %s caught at SIM_SEED=%d (%d seeds): %s", m.name, first.Load(), first.Load()+1, found)
	}
	t.Log(f.line("TestElectionSimCheckerSensitivity"))
}

// firstOf describes the first violation of checker in rep.
func firstOf(rep *sim.ElectReport, checker string) string {
	for _, v := range rep.Violations {
		if v.Checker == checker {
			return v.String()
		}
	}
	return ""
}
