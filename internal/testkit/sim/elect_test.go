package sim_test

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/faultbackend"
	"github.com/ashlock/ashlock/internal/testkit/history"
	"github.com/ashlock/ashlock/internal/testkit/sim"
)

// runElectSeed runs one seed of the election simulation in its own bubble
// and checks its history.
func runElectSeed(t *testing.T, cfg sim.ElectConfig) (*sim.ElectResult, *sim.ElectReport, time.Duration) {
	t.Helper()
	start := time.Now()
	var res *sim.ElectResult
	synctest.Test(t, func(t *testing.T) { res = sim.RunElection(cfg) })
	return res, sim.ElectCheck(res.History), time.Since(start)
}

// failElectSeed writes a failed seed's history and violations and fails t
// with the seed and how to replay it.
func failElectSeed(t *testing.T, test string, res *sim.ElectResult, rep *sim.ElectReport) {
	t.Helper()
	seed := res.History.Seed
	replay := fmt.Sprintf("SIM_SEED=%d go test ./internal/testkit/sim -run '^%s$' -v", seed, test)
	dir := history.ArtifactDir(t, fmt.Sprintf("seed-%d", seed))
	if dir != "" {
		b, err := json.MarshalIndent(struct {
			Replay  string
			Report  *sim.ElectReport
			History *sim.ElectHistory
		}{replay, rep, res.History}, "", " ")
		if err == nil {
			err = os.WriteFile(filepath.Join(dir, "election.json"), b, 0o644)
		}
		if err != nil {
			t.Logf("writing artifacts: %v", err)
		}
	}
	t.Errorf("SIM_SEED=%d: %d anomalies (%s); first: %s\nreplay: %s\nartifacts: %s",
		seed, rep.Anomalies(), rep.Checkers(), rep.First(), replay, dir)
}

// electFigures aggregates the election simulation's figure line over
// seeds. Safe for concurrent use.
type electFigures struct {
	runFigures
	modes     map[string]int
	observers int
	rep       sim.ElectReport
	checkers  map[string]int
}

func newElectFigures() *electFigures {
	f := &electFigures{modes: map[string]int{}, checkers: map[string]int{}, rep: sim.ElectReport{Lock: &history.Report{}}}
	f.init()
	return f
}

func (f *electFigures) add(res *sim.ElectResult, rep *sim.ElectReport, wall time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.addRun(res.History.Lock, res.Counts, res.Active, rep.Anomalies(), res.Fake, wall)
	seen := map[int]bool{}
	for _, in := range res.History.Incarnations {
		if !seen[in.Candidate] {
			seen[in.Candidate] = true
			f.modes[in.Mode]++
		}
	}
	f.observers += res.History.Observers
	r := &f.rep
	r.Terms += rep.Terms
	r.Lost += rep.Lost
	r.Voluntary += rep.Voluntary
	r.Stopped += rep.Stopped
	r.Writes += rep.Writes
	r.Obligations += rep.Obligations
	r.RunReturns += rep.RunReturns
	r.CampaignReturns += rep.CampaignReturns
	r.Observations += rep.Observations
	r.Observed += rep.Observed
	r.Lock.StaleAttempted += rep.Lock.StaleAttempted
	r.Lock.StaleApplied += rep.Lock.StaleApplied
	for _, c := range electFigureCheckers {
		f.checkers[c] += rep.Count(c)
	}
}

// electFigureCheckers are the checkers the figures line counts: the
// election's own, then the lock checkers that apply to terms.
var electFigureCheckers = append(append([]string(nil), sim.ElectCheckers...),
	history.CToken, history.CDBOverlap, history.CGuard, history.CFence, history.CLostUpdate)

func (f *electFigures) line(test string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	kinds := f.kinds()
	var checks []string
	for _, c := range electFigureCheckers {
		checks = append(checks, fmt.Sprintf("%s:%d", c, f.checkers[c]))
	}
	r := &f.rep
	s := fmt.Sprintf("RESULT test=%s backend=memory+faults seeds=%d candidates={run:%d, campaign:%d} observers=%d ops: %s faults=%s "+
		"terms={total:%d, lost:%d, resigned:%d, stopped:%d} fenced_writes=%d stale_writes={attempted:%d, applied:%d} recampaign_obligations=%d "+
		"returns={run:%d, campaign:%d} observations=%d terms_observed=%d violations={%s} anomalies=%d fake_time=%v slowest_seed=%d(%v) wall=%v",
		test, f.seeds, f.modes[sim.ModeRun], f.modes[sim.ModeCampaign], f.observers, sim.FormatOps(f.ops), faultbackend.FormatCounts(f.faults, kinds...),
		r.Terms, r.Lost, r.Voluntary, r.Stopped, r.Writes, r.Lock.StaleAttempted, r.Lock.StaleApplied, r.Obligations,
		r.RunReturns, r.CampaignReturns, r.Observations, r.Observed, strings.Join(checks, ", "), f.anomalies,
		f.fake.Round(time.Second), f.slowSeed, f.slowest.Round(time.Millisecond), time.Since(f.start).Round(time.Millisecond))
	for _, e := range f.extra {
		s += " " + e
	}
	return s
}

// TestElectionSim is the election simulation (issue 15): seeds 0..N-1
// (1,000; 100 under -race; 20,000 with SQLLOCK_LONG=1), 3–5 candidates
// (Run, or Campaign and Resign) and 1–2 observers per seed, each fault
// kind active with probability 1/2, every checker on every seed.
// SIM_SEED=n replays one seed.
func TestElectionSim(t *testing.T) {
	f := newElectFigures()
	if seed, ok := seedFromEnv(t); ok {
		res, rep, wall := runElectSeed(t, sim.ElectConfig{Seed: seed})
		f.add(res, rep, wall)
		if rep.Anomalies() > 0 {
			failElectSeed(t, "TestElectionSim", res, rep)
		}
		t.Log(f.line("TestElectionSim"))
		return
	}
	n := seedCount()
	var failed atomic.Int32
	shardSeeds(t, n, func(t *testing.T, seed uint64) bool {
		if failed.Load() > 3 {
			return false // enough reports
		}
		res, rep, wall := runElectSeed(t, sim.ElectConfig{Seed: seed})
		f.add(res, rep, wall)
		if rep.Anomalies() > 0 {
			failed.Add(1)
			failElectSeed(t, "TestElectionSim", res, rep)
		}
		return true
	})
	t.Log(f.line("TestElectionSim"))
	f.requireConfiguredFired(t)
	require.Zero(t, f.anomalies, "anomalies")
	require.Zero(t, f.rep.Lock.StaleApplied, "stale writes applied")
	// The run exercised what the checkers check.
	require.Positive(t, f.modes[sim.ModeRun])
	require.Positive(t, f.modes[sim.ModeCampaign])
	require.Positive(t, f.rep.Lost, "no term was ever lost")
	require.Positive(t, f.rep.Voluntary, "no leader ever resigned")
	require.Positive(t, f.rep.Stopped, "no leader's process ever stopped")
	require.Positive(t, f.rep.Obligations, "no lost term obliged a campaign")
	require.Positive(t, f.rep.Observed, "no observer ever saw a leader")
}

// TestElectionSimDeterminism: the same seed twice gives the same history
// (20 seeds; 5 under -race, where hashing a history is slow).
func TestElectionSimDeterminism(t *testing.T) {
	f := newElectFigures()
	mismatches := 0
	n := 20
	if raceEnabled {
		n = 5
	}
	if v, err := strconv.Atoi(os.Getenv("SIM_DETERMINISM_SEEDS")); err == nil {
		n = v
	}
	for _, seed := range seedList(t, n) {
		var hashes [2]string
		for i := range hashes {
			res, rep, wall := runElectSeed(t, sim.ElectConfig{Seed: seed})
			f.add(res, rep, wall)
			if rep.Anomalies() > 0 {
				failElectSeed(t, "TestElectionSimDeterminism", res, rep)
			}
			hashes[i] = res.History.Hash()
		}
		if hashes[0] != hashes[1] {
			mismatches++
			t.Errorf("SIM_SEED=%d: two runs gave different histories (%s, %s)", seed, hashes[0][:12], hashes[1][:12])
		}
	}
	f.extra = append(f.extra, fmt.Sprintf("determinism={seeds:%d, runs:2, mismatches:%d}", n, mismatches))
	t.Log(f.line("TestElectionSimDeterminism"))
}
