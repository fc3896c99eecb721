package sim_test

import (
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/history"
	"github.com/ashlock/ashlock/internal/testkit/sim"
)

const scenarioSeeds = 50

// TestSimPause is SIM-4 (Kleppmann's scenario): the holder's whole process
// pauses for 1.5×TTL between its read and its write. The other client
// takes the key only after the database deadline (C-DBOVERLAP), the paused
// holder's late writes are refused by the fence once the new holder has
// read (C-FENCE, applied = 0), and its overlap with the new holder is
// reported as the documented paused-holder case, not as an anomaly.
func TestSimPause(t *testing.T) {
	f := newFigures()
	pausedOverlaps := 0
	for _, seed := range seedList(t, scenarioSeeds) {
		res, rep, model, info, wall := runSeed(t, sim.Config{Seed: seed, Scenario: sim.Paused})
		f.add(res, rep, wall)
		if rep.Anomalies() > 0 {
			failSeed(t, "TestSimPause", res, rep, model, info)
		}
		pausedOverlaps += rep.PausedOverlaps
	}
	t.Log(f.line("TestSimPause"))
	f.requireConfiguredFired(t)
	require.Positive(t, pausedOverlaps, "no paused holder ever overlapped the next holder: the scenario tested nothing")
	require.Positive(t, f.rep.ZombieRejected, "no write of a paused holder was refused")
	require.Zero(t, f.rep.StaleApplied)
}

// TestSimDBClockStep is SIM-5: the database clock steps forward by twice
// the margin while A holds, beyond assumption A2. The next holder may then
// start while A's guard is still valid: C-GUARD detects that overlap (it
// is an anomaly unless the run declares such steps), and the fence still
// applies no stale write.
func TestSimDBClockStep(t *testing.T) {
	f := newFigures()
	clockOverlaps, detected := 0, 0
	for _, seed := range seedList(t, scenarioSeeds) {
		res, rep, model, info, wall := runSeed(t, sim.Config{Seed: seed, Scenario: sim.ClockStep})
		f.add(res, rep, wall)
		if rep.Anomalies() > 0 {
			failSeed(t, "TestSimDBClockStep", res, rep, model, info)
		}
		clockOverlaps += rep.ClockOverlaps
		// Without the declaration the same history is an anomaly.
		h := *res.History
		h.Params.ClockStepsBeyondMargin = false
		strict := &history.Report{}
		history.CheckGuard(&h, strict)
		// An overlap that is no longer excused by the clock step is
		// reported.
		detected += strict.Count(history.CGuard)
	}
	f.extra = append(f.extra, fmt.Sprintf("guard_overlaps_if_undeclared=%d", detected))
	t.Log(f.line("TestSimDBClockStep"))
	f.requireConfiguredFired(t)
	require.Positive(t, clockOverlaps, "the clock step never made two guards overlap: the scenario tested nothing")
	require.Equal(t, clockOverlaps, detected, "C-GUARD must report every clock-step overlap when steps are not declared")
	require.Zero(t, f.rep.StaleApplied)
}
