package history

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/anishathalye/porcupine"
)

// ArtifactDir returns a directory for a failed run's artifacts that
// outlives the test: $SQLLOCK_ARTIFACTS/<test>/<sub>, or a new directory
// under the system's temp dir. It logs where it is.
func ArtifactDir(t testing.TB, sub string) string {
	t.Helper()
	name := regexp.MustCompile(`[^A-Za-z0-9_.=-]+`).ReplaceAllString(t.Name(), "_")
	var dir string
	if root := os.Getenv("SQLLOCK_ARTIFACTS"); root != "" {
		dir = filepath.Join(root, name, sub)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Logf("artifacts: %v", err)
			return ""
		}
	} else {
		d, err := os.MkdirTemp("", "ashlock-"+name+"-"+sub+"-")
		if err != nil {
			t.Logf("artifacts: %v", err)
			return ""
		}
		dir = d
	}
	t.Logf("artifacts in %s", dir)
	return dir
}

// WriteArtifacts writes history.json, violations.txt and, when info is
// given, porcupine's history.html to dir.
func WriteArtifacts(dir string, h *History, r *Report, model *porcupine.Model, info *porcupine.LinearizationInfo, replay string) error {
	if dir == "" {
		return nil
	}
	b, err := json.MarshalIndent(h, "", " ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "history.json"), b, 0o644); err != nil {
		return err
	}
	var sb strings.Builder
	fmt.Fprintf(&sb, "seed %d\nreplay: %s\n\n", h.Seed, replay)
	if r != nil {
		fmt.Fprintf(&sb, "first violation: %s\n\nall %d violations:\n", r.First(), len(r.Violations))
		for _, v := range r.Violations {
			fmt.Fprintln(&sb, v.String())
		}
		rb, _ := json.MarshalIndent(r, "", " ")
		fmt.Fprintf(&sb, "\nreport: %s\n", rb)
	}
	if err := os.WriteFile(filepath.Join(dir, "violations.txt"), []byte(sb.String()), 0o644); err != nil {
		return err
	}
	if model != nil && info != nil {
		return porcupine.VisualizePath(*model, *info, filepath.Join(dir, "history.html"))
	}
	return nil
}
