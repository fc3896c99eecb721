package sim_test

import (
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/faultbackend"
	"github.com/ashlock/ashlock/internal/testkit/history"
	"github.com/ashlock/ashlock/internal/testkit/sim"
)

const linTimeout = 60 * time.Second

// seedCount is the number of seeds of SIM-1: 1,000 normally, 100 under
// -race, 20,000 with SQLLOCK_LONG=1.
func seedCount() int {
	switch {
	case os.Getenv("SQLLOCK_LONG") == "1":
		return 20000
	case raceEnabled:
		return 100
	}
	return 1000
}

// seedFromEnv returns SIM_SEED when set: replay that one seed.
func seedFromEnv(t *testing.T) (uint64, bool) {
	s := os.Getenv("SIM_SEED")
	if s == "" {
		return 0, false
	}
	n, err := strconv.ParseUint(s, 10, 64)
	require.NoError(t, err, "SIM_SEED")
	return n, true
}

// seedList is 0..n-1, or only SIM_SEED when it is set.
func seedList(t *testing.T, n int) []uint64 {
	if seed, ok := seedFromEnv(t); ok {
		return []uint64{seed}
	}
	out := make([]uint64, n)
	for i := range out {
		out[i] = uint64(i)
	}
	return out
}

// runSeed runs one seed in its own bubble and checks its history.
func runSeed(t *testing.T, cfg sim.Config) (*sim.Result, *history.Report, porcupine.Model, porcupine.LinearizationInfo, time.Duration) {
	t.Helper()
	start := time.Now()
	var res *sim.Result
	synctest.Test(t, func(t *testing.T) { res = sim.Run(cfg) })
	rep := history.Check(res.History)
	model, info := history.CheckLin(res.History, rep, true, linTimeout)
	return res, rep, model, info, time.Since(start)
}

// failSeed writes the artifacts of a failed seed and fails t with the seed
// and how to replay it.
func failSeed(t *testing.T, test string, res *sim.Result, rep *history.Report, model porcupine.Model, info porcupine.LinearizationInfo) {
	t.Helper()
	replay := fmt.Sprintf("SIM_SEED=%d go test ./internal/testkit/sim -run '^%s$' -v", res.History.Seed, test)
	dir := history.ArtifactDir(t, fmt.Sprintf("seed-%d", res.History.Seed))
	if err := history.WriteArtifacts(dir, res.History, rep, &model, &info, replay); err != nil {
		t.Logf("writing artifacts: %v", err)
	}
	t.Errorf("SIM_SEED=%d: %d anomalies (%s); first: %s\nreplay: %s\nartifacts: %s",
		res.History.Seed, rep.Anomalies(), rep.Checkers(), rep.First(), replay, dir)
}

// figures aggregates the H8 figure line over seeds. Safe for concurrent use.
// runFigures is what every simulation's figures line counts, whatever it
// simulates: seeds, ops, faults, anomalies and time. Embedded by figures
// (the lock simulation) and electFigures (the election's).
type runFigures struct {
	mu         sync.Mutex
	start      time.Time
	seeds      int
	ops        map[string]map[history.Outcome]int
	faults     map[faultbackend.Kind]int64
	configured map[faultbackend.Kind]bool
	anomalies  int
	slowest    time.Duration
	slowSeed   uint64
	fake       time.Duration
	extra      []string
}

func (f *runFigures) init() {
	f.start = time.Now()
	f.ops = map[string]map[history.Outcome]int{}
	f.faults = map[faultbackend.Kind]int64{}
	f.configured = map[faultbackend.Kind]bool{}
}

// addRun counts one seed's run. f.mu is held.
func (f *runFigures) addRun(h *history.History, counts map[faultbackend.Kind]int64, active []faultbackend.Kind,
	anomalies int, fake, wall time.Duration) {
	f.seeds++
	sim.OpCounts(h, f.ops)
	for k, v := range counts {
		f.faults[k] += v
	}
	for _, k := range active {
		f.configured[k] = true
	}
	f.anomalies += anomalies
	f.fake += fake
	if wall > f.slowest {
		f.slowest, f.slowSeed = wall, h.Seed
	}
}

// kinds are the configured fault kinds, in order. f.mu is held.
func (f *runFigures) kinds() []faultbackend.Kind {
	var kinds []faultbackend.Kind
	for k := range f.configured {
		kinds = append(kinds, k)
	}
	sort.Slice(kinds, func(i, j int) bool { return kinds[i] < kinds[j] })
	return kinds
}

// requireConfiguredFired fails t for each configured fault kind that was
// never injected: a fault that never fired tested nothing.
func (f *runFigures) requireConfiguredFired(t *testing.T) {
	t.Helper()
	f.mu.Lock()
	defer f.mu.Unlock()
	for k := range f.configured {
		require.Positive(t, f.faults[k], "fault kind %s was configured but injected 0 times", k)
	}
}

type figures struct {
	runFigures
	rep     history.Report
	lin     map[string]int
	linTime time.Duration
}

func newFigures() *figures {
	f := &figures{lin: map[string]int{}}
	f.init()
	return f
}

func (f *figures) add(res *sim.Result, rep *history.Report, wall time.Duration) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.addRun(res.History, res.Counts, res.Active, rep.Anomalies(), res.Fake, wall)
	f.rep.StaleAttempted += rep.StaleAttempted
	f.rep.StaleRejected += rep.StaleRejected
	f.rep.StaleApplied += rep.StaleApplied
	f.rep.ZombieWrites += rep.ZombieWrites
	f.rep.ZombieRejected += rep.ZombieRejected
	f.rep.AcceptedWrites += rep.AcceptedWrites
	f.rep.PausedOverlaps += rep.PausedOverlaps
	f.rep.ForcedOverlaps += rep.ForcedOverlaps
	f.rep.ClockOverlaps += rep.ClockOverlaps
	f.rep.LiveObligations += rep.LiveObligations
	f.rep.Violations = append(f.rep.Violations, rep.Violations...)
	f.lin[rep.Lin]++
	f.linTime += rep.LinTime
}

func (f *figures) line(test string) string {
	f.mu.Lock()
	defer f.mu.Unlock()
	kinds := f.kinds()
	var lins []string
	for k, v := range f.lin {
		lins = append(lins, fmt.Sprintf("%s:%d", k, v))
	}
	sort.Strings(lins)
	r := &f.rep
	s := fmt.Sprintf("RESULT test=%s backend=memory+faults seeds=%d ops: %s faults=%s "+
		"stale_writes={attempted:%d, rejected:%d, applied:%d} zombie_writes={attempted:%d, rejected:%d} accepted_writes=%d "+
		"lin={%s, time:%v} token_regressions=%d db_overlaps=%d guard_violations=%d fence_violations=%d lost_updates=%d liveness_violations=%d live_obligations=%d "+
		"paused_overlaps=%d forced_overlaps=%d clock_overlaps=%d anomalies=%d fake_time=%v slowest_seed=%d(%v) wall=%v",
		test, f.seeds, sim.FormatOps(f.ops), faultbackend.FormatCounts(f.faults, kinds...),
		r.StaleAttempted, r.StaleRejected, r.StaleApplied, r.ZombieWrites, r.ZombieRejected, r.AcceptedWrites,
		strings.Join(lins, " "), f.linTime.Round(time.Millisecond),
		r.Count(history.CToken), r.Count(history.CDBOverlap), r.Count(history.CGuard), r.Count(history.CFence),
		r.Count(history.CLostUpdate), r.Count(history.CLive), r.LiveObligations,
		r.PausedOverlaps, r.ForcedOverlaps, r.ClockOverlaps, f.anomalies, f.fake.Round(time.Second),
		f.slowSeed, f.slowest.Round(time.Millisecond), time.Since(f.start).Round(time.Millisecond))
	for _, e := range f.extra {
		s += " " + e
	}
	return s
}
