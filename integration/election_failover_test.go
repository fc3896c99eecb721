//go:build unix

package integration

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/pgtest"
)

// The election failover tests (issue: leader election) run real processes:
// four `sqllock elect` candidates of one election, each running a command
// that records its term; the leader's host dies (SIGKILL of sqllock and of
// its command's process group: nothing releases the term), and a new leader
// must take over within TTL + poll + one round trip, with a greater term,
// while exactly one candidate's command runs. Three leaders die in turn.

var sqllockBin struct {
	once sync.Once
	path string
	err  error
}

// buildSqllock builds cmd/sqllock once per test binary.
func buildSqllock(t *testing.T) string {
	t.Helper()
	sqllockBin.once.Do(func() {
		dir, err := os.MkdirTemp("", "sqllock-bin-")
		if err != nil {
			sqllockBin.err = err
			return
		}
		sqllockBin.path = filepath.Join(dir, "sqllock")
		out, err := exec.Command("go", "build", "-o", sqllockBin.path, "github.com/ashlock/ashlock/cmd/sqllock").CombinedOutput()
		if err != nil {
			sqllockBin.err = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	require.NoError(t, sqllockBin.err)
	return sqllockBin.path
}

func TestElectionFailoverSQLite(t *testing.T) {
	t.Parallel()
	failover(t, "sqlite", "sqlite:"+filepath.Join(t.TempDir(), "locks.db"))
}

func TestElectionFailoverPostgres(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	migrateUp(context.Background(), t, db)
	failover(t, "postgres", db.URL)
}

const (
	failoverTTL = 2 * time.Second
	// failoverSlack bounds what a takeover may take beyond the dead
	// leader's remaining TTL: a waiting candidate's poll (the client's
	// backoff, at most 250 ms), one round trip, and starting the command
	// (a process) on a loaded 2-core machine.
	failoverSlack = time.Second
)

type candidate struct {
	id  string
	cmd *exec.Cmd
}

func failover(t *testing.T, dialect, url string) {
	bin := buildSqllock(t)
	dir := t.TempDir()
	script := filepath.Join(dir, "lead.sh")
	// The command records "<candidate> <term>" and its pid (the leader of
	// its own process group), then runs until stopped.
	require.NoError(t, os.WriteFile(script, []byte(`echo $$ > "$1.pid"
echo "$1 $SQLLOCK_TERM" >> terms
exec sleep 1000
`), 0o755))
	var cands []*candidate
	defer func() {
		for _, c := range cands {
			killHost(t, dir, c)
		}
	}()
	for i := range 4 {
		id := fmt.Sprintf("c%d", i+1)
		cmd := exec.Command(bin, "elect", "--name", "failover", "--ttl", failoverTTL.String(), "--grace", "1s",
			"--value", id, "--database-url", url, "--", "sh", script, id)
		cmd.Dir = dir
		cmd.Stdout = os.Stderr
		cmd.Stderr = os.Stderr
		require.NoError(t, cmd.Start())
		cands = append(cands, &candidate{id: id, cmd: cmd})
	}

	var (
		terms     []int64
		takeovers []time.Duration
	)
	leader, term := waitTerm(t, dir, 1, 30*time.Second)
	terms = append(terms, term)
	for round := 1; round <= 3; round++ {
		require.Equal(t, 1, liveCommands(t, dir, cands), "round %d: exactly one candidate's command runs", round)
		var dead *candidate
		for _, c := range cands {
			if c.id == leader {
				dead = c
			}
		}
		require.NotNil(t, dead, "term %d names an unknown candidate %q", term, leader)
		killed := time.Now()
		killHost(t, dir, dead)
		leader, term = waitTerm(t, dir, round+1, failoverTTL+10*time.Second)
		took := time.Since(killed)
		takeovers = append(takeovers, took)
		require.Greater(t, term, terms[len(terms)-1], "terms strictly increase")
		require.NotEqual(t, dead.id, leader, "a dead candidate led again")
		terms = append(terms, term)
		// The 5 ms polling of the terms file adds at most that much.
		require.LessOrEqual(t, took, failoverTTL+failoverSlack+5*time.Millisecond,
			"round %d: takeover after %v, more than TTL %v + %v", round, took, failoverTTL, failoverSlack)
	}
	require.Equal(t, 1, liveCommands(t, dir, cands), "after the last takeover exactly one command runs")
	var longest time.Duration
	ms := make([]string, len(takeovers))
	for i, d := range takeovers {
		ms[i] = strconv.FormatInt(d.Milliseconds(), 10)
		longest = max(longest, d)
	}
	t.Logf("figures: election failover (%s, 4 candidates, TTL %v): leaders killed=3 terms=%v takeover_ms=[%s] max=%v bound=%v anomalies=0",
		dialect, failoverTTL, terms, strings.Join(ms, " "), longest.Round(time.Millisecond), failoverTTL+failoverSlack)
}

// waitTerm waits until the terms file has n lines and returns the last:
// the leader and its term. It fails if more than n appear (two leaders).
func waitTerm(t *testing.T, dir string, n int, within time.Duration) (string, int64) {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		lines := readLines(t, filepath.Join(dir, "terms"))
		require.LessOrEqual(t, len(lines), n, "more terms than leaders killed: %q", lines)
		if len(lines) == n {
			f := strings.Fields(lines[n-1])
			require.Len(t, f, 2, "terms line %q", lines[n-1])
			term, err := strconv.ParseInt(f[1], 10, 64)
			require.NoError(t, err)
			return f[0], term
		}
		if time.Now().After(deadline) {
			t.Fatalf("no term %d within %v; terms so far %q", n, within, lines)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func readLines(t *testing.T, path string) []string {
	t.Helper()
	f, err := os.Open(path)
	if os.IsNotExist(err) {
		return nil
	}
	require.NoError(t, err)
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if sc.Text() != "" {
			out = append(out, sc.Text())
		}
	}
	require.NoError(t, sc.Err())
	return out
}

// liveCommands counts the candidates whose command runs now.
func liveCommands(t *testing.T, dir string, cands []*candidate) int {
	t.Helper()
	n := 0
	for _, c := range cands {
		if pid := commandPID(dir, c); pid > 0 && syscall.Kill(pid, 0) == nil && !zombie(pid) {
			n++
		}
	}
	return n
}

func commandPID(dir string, c *candidate) int {
	data, err := os.ReadFile(filepath.Join(dir, c.id+".pid"))
	if err != nil {
		return 0
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(data)))
	return pid
}

// zombie reports whether pid has exited but not been reaped.
func zombie(pid int) bool {
	data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false // not Linux, or gone
	}
	s := string(data)
	i := strings.LastIndexByte(s, ')')
	return i > 0 && i+2 < len(s) && s[i+2] == 'Z'
}

// killHost kills a candidate as a host crash would: sqllock and its
// command's process group at once, with SIGKILL; nothing is released.
func killHost(t *testing.T, dir string, c *candidate) {
	t.Helper()
	if c.cmd.Process == nil || c.cmd.ProcessState != nil {
		return
	}
	_ = c.cmd.Process.Kill()
	if pid := commandPID(dir, c); pid > 0 {
		_ = syscall.Kill(-pid, syscall.SIGKILL)
	}
	_ = c.cmd.Wait()
	if pid := commandPID(dir, c); pid > 0 {
		_ = syscall.Kill(-pid, syscall.SIGKILL)
		_ = os.Remove(filepath.Join(dir, c.id+".pid"))
	}
}
