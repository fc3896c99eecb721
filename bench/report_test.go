package main

import (
	"flag"
	"strings"
	"testing"
	"time"
)

// The report's first line names the command as run, and calls it the
// default run only when it was: a run of some sections or rounds must not
// pass for the committed results.
func TestReportNamesItsRun(t *testing.T) {
	for _, tc := range []struct {
		r    Report
		want string
	}{
		{Report{}, "`cd bench && go run .` (default run)"},
		{Report{Quick: true, Flags: []string{"-quick=true"}}, "`cd bench && go run . -quick=true` (`-quick` run)"},
		{Report{Flags: []string{"-only=multikey", "-rounds=3"}}, "`cd bench && go run . -only=multikey -rounds=3` (not the default run"},
		{Report{Quick: true, Flags: []string{"-quick=true", "-only=pg"}}, "(not the default run"},
	} {
		tc.r.Started = time.Date(2026, 12, 3, 0, 0, 0, 0, time.UTC)
		md := tc.r.markdown()
		if first := strings.SplitN(md, "\n", 4)[2]; !strings.Contains(first, tc.want) {
			t.Errorf("flags %q: first line %q, want %q in it", tc.r.Flags, first, tc.want)
		}
	}
}

// runFlags shows what changed the run, never a URL's value.
func TestRunFlagsHideURLs(t *testing.T) {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.String("database-url", "", "")
	fs.String("etcd-endpoints", "", "")
	fs.String("out", "results", "")
	fs.Int("rounds", 0, "")
	fs.Bool("quick", false, "")
	if err := fs.Parse([]string{"-database-url", "postgres://u:s3cret@h/db", "-etcd-endpoints", "http://u:pw@h:2379", "-out", "/tmp/x", "-rounds", "3", "-quick"}); err != nil {
		t.Fatal(err)
	}
	got := strings.Join(runFlags(fs), " ")
	if want := "-database-url=… -etcd-endpoints=… -quick=true -rounds=3"; got != want {
		t.Errorf("runFlags = %q, want %q", got, want)
	}
	for _, secret := range []string{"s3cret", "pw", "u:", "/tmp/x"} {
		if strings.Contains(got, secret) {
			t.Errorf("runFlags shows %q: %q", secret, got)
		}
	}
}
