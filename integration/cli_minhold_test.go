//go:build linux

package integration

import (
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/pgtest"
)

// The scheduled-job recipe with real processes (issue 26): two hosts'
// crontabs fire `sqllock run --key K --min-hold 1m -- JOB` a second apart
// on one database; the job takes well under a second. The first runs it
// and exits with the job's status; the second, fired after the first has
// exited (its release sent), finds the key still held by the first's
// owner and exits 75 (not acquired) without running it.

// cronJob appends its id, token and owner to runs, then works 200 ms.
const cronJob = `echo "$1 $SQLLOCK_TOKEN $SQLLOCK_OWNER" >> runs
sleep 0.2
`

// cronSkew is how much later the second crontab fires than the first.
const cronSkew = time.Second

func TestMinHoldTwoCrontabsSQLite(t *testing.T) {
	t.Parallel()
	twoCrontabs(t, "sqlite:"+filepath.Join(t.TempDir(), "locks.db"))
}

func TestMinHoldTwoCrontabsPostgres(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	migrateUp(context.Background(), t, db)
	twoCrontabs(t, db.URL)
}

func twoCrontabs(t *testing.T, dbURL string) {
	bin, dir := buildSqllock(t), t.TempDir()
	require.NoError(t, os.WriteFile(filepath.Join(dir, "job.sh"), []byte(cronJob), 0o755))
	cron := func(id string) (*exec.Cmd, *strings.Builder) {
		out := &strings.Builder{}
		c := exec.Command(bin, "run", "--key", "hourly", "--min-hold", "1m", "--database-url", dbURL, "--", "sh", "job.sh", id)
		c.Dir, c.Stdout, c.Stderr = dir, out, out
		require.NoError(t, c.Start())
		t.Cleanup(func() {
			if c.ProcessState == nil {
				_ = c.Process.Kill()
				_ = c.Wait()
			}
			if t.Failed() {
				t.Logf("sqllock run %s's output:\n%s", id, out)
			}
		})
		return c, out
	}

	fired := time.Now()
	a, _ := cron("a")
	require.Zero(t, exitCode(t, a, 30*time.Second), "the first crontab's job status")
	aDone := time.Now()
	time.Sleep(time.Until(fired.Add(cronSkew)))
	b, bOut := cron("b")
	require.Equal(t, 75, exitCode(t, b, 30*time.Second), "the second crontab: not acquired")

	data, err := os.ReadFile(filepath.Join(dir, "runs"))
	require.NoError(t, err)
	runs := strings.Split(strings.TrimSpace(string(data)), "\n")
	require.Len(t, runs, 1, "the job ran more than once: %q", runs)
	f := strings.Fields(runs[0])
	require.Len(t, f, 3, "%q", runs[0])
	require.Equal(t, "a", f[0])
	token, owner := f[1], f[2]
	require.Contains(t, bOut.String(), `by "`+owner+`" (token `+token+`)`, "the refusal names the first crontab's lease")

	// After the first crontab exited, the key is held by its owner, with
	// its token, until the min hold ends (a minute after the grant).
	out, err := exec.Command(bin, "list", "--json", "--database-url", dbURL).Output()
	require.NoError(t, err)
	var locks []struct {
		Key         string    `json:"key"`
		Held        bool      `json:"held"`
		Owner       string    `json:"owner"`
		Token       int64     `json:"token"`
		Deadline    time.Time `json:"deadline"`
		RemainingMS int64     `json:"remaining_ms"`
	}
	require.NoError(t, json.Unmarshal(out, &locks), "%s", out)
	require.Len(t, locks, 1, "%s", out)
	l := locks[0]
	require.Equal(t, "hourly", l.Key)
	require.True(t, l.Held, "the key is not held after the first crontab's release: %s", out)
	require.Equal(t, owner, l.Owner)
	require.Equal(t, token, jsonInt(l.Token))
	remaining := time.Duration(l.RemainingMS) * time.Millisecond
	require.Greater(t, remaining, 50*time.Second, "the min hold of 1m is mostly left (%s)", out)
	require.LessOrEqual(t, remaining, time.Minute)
	t.Logf("figures: two crontabs %v apart with --min-hold 1m: the first ran and exited in %v, the second exited 75; the key held %v more by %s (token %s)",
		cronSkew, aDone.Sub(fired).Round(time.Millisecond), remaining.Round(time.Second), owner, token)
}

func jsonInt(n int64) string {
	b, _ := json.Marshal(n)
	return string(b)
}
