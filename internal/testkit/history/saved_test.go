package history_test

import (
	"encoding/json"
	"os"
	"sort"
	"testing"
	"time"

	"github.com/anishathalye/porcupine"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/history"
)

// TestCheckSavedHistory re-checks a history.json written by a failed run:
// SQLLOCK_HISTORY=/path/to/history.json go test ./internal/testkit/history -run
// TestCheckSavedHistory -v. For each key that porcupine refuses, it prints
// the end of the longest linearizable prefix and the first calls left out.
// It fails when the history has any anomaly or porcupine does not find it
// linearizable (or times out), so that a re-check of a bad history never
// reads as a pass.
func TestCheckSavedHistory(t *testing.T) {
	path := os.Getenv("SQLLOCK_HISTORY")
	if path == "" {
		t.Skip("SQLLOCK_HISTORY names a history.json to check")
	}
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	var h history.History
	require.NoError(t, json.Unmarshal(b, &h))
	r := history.Check(&h)
	for _, v := range r.Violations {
		t.Error(v.String())
	}
	model := history.Model(h.Params.TokenStep1)
	for _, part := range model.Partition(history.LinOperations(&h, true)) {
		res, info := porcupine.CheckOperationsVerbose(model, part, time.Minute)
		key := part[0].Input.(history.LinInput).Key
		if res == porcupine.Ok {
			t.Logf("key %q: %s over %d operations", key, res, len(part))
			continue
		}
		// Illegal, or Unknown when the check timed out: neither is a pass.
		t.Errorf("key %q: porcupine says %s over %d operations", key, res, len(part))
		var best []int
		for _, ls := range info.PartialLinearizations() {
			for _, l := range ls {
				if len(l) > len(best) {
					best = l
				}
			}
		}
		in := map[int]bool{}
		for _, i := range best {
			in[i] = true
		}
		for _, i := range best[max(0, len(best)-8):] {
			o := part[i]
			t.Logf("  linearized  c%d [%v, %v] %s", o.ClientId, time.Duration(o.Call), time.Duration(o.Return), model.DescribeOperation(o.Input, o.Output))
		}
		var out []int
		for i := range part {
			if !in[i] {
				out = append(out, i)
			}
		}
		sort.Slice(out, func(a, b int) bool { return part[out[a]].Call < part[out[b]].Call })
		for _, i := range out[:min(8, len(out))] {
			o := part[i]
			t.Logf("  left out    c%d [%v, %v] %s", o.ClientId, time.Duration(o.Call), time.Duration(o.Return), model.DescribeOperation(o.Input, o.Output))
		}
	}
}
