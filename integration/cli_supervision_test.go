//go:build linux

package integration

import (
	"context"
	"encoding/json"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/faultproxy"
	"github.com/ashlock/ashlock/internal/testkit/pgtest"
)

// The supervision tests (G9) run `sqllock run` and `sqllock elect` as real
// processes and hurt sqllock, never its command: SIGKILL, SIGSTOP for
// longer than the TTL, a database it can no longer reach. The command must
// be gone (with its child) by the lease's local deadline, so that the next
// holder, waiting with --wait, never runs beside it. Each command writes
// its start (wall clock, ns) to a file; a poller records when each
// command and its child were first seen gone. Overlap is measured: every
// start must come after the previous command was gone.

const (
	supTTL   = 2 * time.Second
	supGrace = time.Second
)

// supJob is the command: $1 its id, $2 "term" (exits on SIGTERM) or
// "ignore" (it and its child ignore SIGTERM: only SIGKILL stops them).
const supJob = `if [ "$2" = ignore ]; then trap '' TERM; else trap 'kill $child 2>/dev/null; exit 0' TERM; fi
sleep 1000 &
child=$!
echo "$1 $(date +%s%N)" >> starts
echo "$$ $child" > "$1.pids.tmp" && mv "$1.pids.tmp" "$1.pids"
wait $child
`

type supWorld struct {
	t        *testing.T
	bin, dir string

	mu    sync.Mutex
	gone  map[string]time.Time // id: when its command and child were first seen gone
	procs []*exec.Cmd          // every sqllock started
}

func newSupWorld(t *testing.T) *supWorld {
	w := &supWorld{t: t, bin: buildSqllock(t), dir: t.TempDir(), gone: map[string]time.Time{}}
	require.NoError(t, os.WriteFile(filepath.Join(w.dir, "job.sh"), []byte(supJob), 0o755))
	stop, done := make(chan struct{}), make(chan struct{})
	go w.poll(stop, done)
	t.Cleanup(func() {
		close(stop)
		<-done
		for _, c := range w.procs {
			if c.ProcessState == nil {
				_ = c.Process.Kill()
				_ = c.Wait()
			}
		}
		for _, id := range w.ids() {
			for _, pid := range w.pids(id) {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
	})
	return w
}

// start starts sqllock with args, its output going to the test's log file.
func (w *supWorld) start(id string, args ...string) *exec.Cmd {
	out, err := os.Create(filepath.Join(w.dir, id+".out"))
	require.NoError(w.t, err)
	cmd := exec.Command(w.bin, args...)
	cmd.Dir, cmd.Stdout, cmd.Stderr = w.dir, out, out
	require.NoError(w.t, cmd.Start())
	out.Close()
	w.mu.Lock()
	w.procs = append(w.procs, cmd)
	w.mu.Unlock()
	w.t.Cleanup(func() {
		if w.t.Failed() {
			data, _ := os.ReadFile(filepath.Join(w.dir, id+".out"))
			w.t.Logf("sqllock %s's output:\n%s", id, data)
		}
	})
	return cmd
}

// run starts `sqllock run` of command id (mode: term or ignore).
func (w *supWorld) run(id, mode, dbURL string, extra ...string) *exec.Cmd {
	args := append([]string{"run", "--key", "sup", "--ttl", supTTL.String(), "--grace", supGrace.String(), "--database-url", dbURL}, extra...)
	return w.start(id, append(args, "--", "sh", "job.sh", id, mode)...)
}

// ids are the commands that wrote their pids.
func (w *supWorld) ids() []string {
	m, _ := filepath.Glob(filepath.Join(w.dir, "*.pids"))
	out := make([]string, len(m))
	for i, p := range m {
		out[i] = strings.TrimSuffix(filepath.Base(p), ".pids")
	}
	return out
}

func (w *supWorld) pids(id string) []int {
	data, _ := os.ReadFile(filepath.Join(w.dir, id+".pids"))
	var out []int
	for _, f := range strings.Fields(string(data)) {
		if pid, err := strconv.Atoi(f); err == nil {
			out = append(out, pid)
		}
	}
	return out
}

// poll records, every 5 ms, the commands whose processes are all gone.
func (w *supWorld) poll(stop <-chan struct{}, done chan<- struct{}) {
	defer close(done)
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
		}
		for _, id := range w.ids() {
			w.mu.Lock()
			_, seen := w.gone[id]
			w.mu.Unlock()
			if seen {
				continue
			}
			alive := false
			for _, pid := range w.pids(id) {
				if syscall.Kill(pid, 0) == nil && !zombie(pid) {
					alive = true
				}
			}
			if !alive {
				w.mu.Lock()
				w.gone[id] = time.Now()
				w.mu.Unlock()
			}
		}
	}
}

// waitStarted waits until command id has written its pids.
func (w *supWorld) waitStarted(id string, within time.Duration) {
	w.t.Helper()
	deadline := time.Now().Add(within)
	for len(w.pids(id)) < 2 {
		if time.Now().After(deadline) {
			w.t.Fatalf("command %s did not start within %v", id, within)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// waitGone waits until command id and its child are gone; it returns when
// they were first seen gone.
func (w *supWorld) waitGone(id string, within time.Duration) time.Time {
	w.t.Helper()
	deadline := time.Now().Add(within)
	for {
		w.mu.Lock()
		g, ok := w.gone[id]
		w.mu.Unlock()
		if ok {
			return g
		}
		if time.Now().After(deadline) {
			w.t.Fatalf("command %s (pids %v) still runs %v later", id, w.pids(id), within)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// starts are the commands' start lines: id and wall-clock instant, in
// order of start.
func (w *supWorld) starts() ([]string, []time.Time) {
	data, _ := os.ReadFile(filepath.Join(w.dir, "starts"))
	type st struct {
		id string
		at time.Time
	}
	var all []st
	for _, line := range strings.Split(strings.TrimSpace(string(data)), "\n") {
		f := strings.Fields(line)
		if len(f) != 2 {
			continue
		}
		ns, err := strconv.ParseInt(f[1], 10, 64)
		require.NoError(w.t, err, "start line %q", line)
		all = append(all, st{f[0], time.Unix(0, ns)})
	}
	sort.Slice(all, func(i, j int) bool { return all[i].at.Before(all[j].at) })
	ids, ats := make([]string, len(all)), make([]time.Time, len(all))
	for i, s := range all {
		ids[i], ats[i] = s.id, s.at
	}
	return ids, ats
}

// checkNoOverlap fails if a command started before the one before it was
// gone; it returns the gaps between one's end and the next's start.
func (w *supWorld) checkNoOverlap() []time.Duration {
	w.t.Helper()
	ids, ats := w.starts()
	var gaps []time.Duration
	for i := 1; i < len(ids); i++ {
		w.mu.Lock()
		g, ok := w.gone[ids[i-1]]
		w.mu.Unlock()
		require.True(w.t, ok, "%s started at %v while %s still ran", ids[i], ats[i].Format(time.StampMicro), ids[i-1])
		require.True(w.t, g.Before(ats[i]), "%s started at %v, before %s was gone (%v): two commands at once",
			ids[i], ats[i].Format(time.StampMicro), ids[i-1], g.Format(time.StampMicro))
		gaps = append(gaps, ats[i].Sub(g))
	}
	return gaps
}

// dbDeadline is the database deadline of the lease on key, by `sqllock list`.
func (w *supWorld) dbDeadline(dbURL, key string) time.Time {
	w.t.Helper()
	out, err := exec.Command(w.bin, "list", "--json", "--database-url", dbURL).Output()
	require.NoError(w.t, err)
	var locks []struct {
		Key      string    `json:"key"`
		Held     bool      `json:"held"`
		Deadline time.Time `json:"deadline"`
	}
	require.NoError(w.t, json.Unmarshal(out, &locks), "%s", out)
	for _, l := range locks {
		if l.Key == key && l.Held {
			return l.Deadline
		}
	}
	w.t.Fatalf("%q is not held: %s", key, out)
	return time.Time{}
}

func exitCode(t *testing.T, c *exec.Cmd, within time.Duration) int {
	t.Helper()
	done := make(chan struct{})
	go func() { _ = c.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(within):
		t.Fatalf("sqllock did not exit within %v", within)
	}
	return c.ProcessState.ExitCode()
}

// kill -9 of `sqllock run`: the command (which exits on SIGTERM) and its
// child are gone within 1 s and before the lease's database deadline; the
// next `run --wait`, started at the kill, never overlaps it.
func TestSupervisionKill9(t *testing.T) {
	t.Parallel()
	w := newSupWorld(t)
	db := "sqlite:" + filepath.Join(w.dir, "locks.db")
	r1 := w.run("a", "term", db)
	w.waitStarted("a", 10*time.Second)
	dl := w.dbDeadline(db, "sup")
	require.NoError(t, r1.Process.Kill())
	killed := time.Now()
	w.run("b", "term", db, "--wait", "20s")
	gone := w.waitGone("a", 5*time.Second)
	require.Less(t, gone.Sub(killed), time.Second, "the command outlived sqllock's kill -9 by more than 1s")
	require.True(t, gone.Before(dl), "the command was gone at %v, after the lease's database deadline %v", gone, dl)
	w.waitStarted("b", 10*time.Second)
	gaps := w.checkNoOverlap()
	t.Logf("figures: kill -9 of sqllock run (TTL %v): command gone %v after the kill, %v before the database deadline; next holder started %v after",
		supTTL, gone.Sub(killed).Round(time.Millisecond), dl.Sub(gone).Round(time.Millisecond), gaps[0].Round(time.Millisecond))
}

// SIGSTOP of `sqllock run` for longer than the TTL: the command, which
// ignores SIGTERM, is killed by the local deadline (before the database
// deadline), and the next holder never overlaps it; continued, sqllock
// reports the loss (76).
func TestSupervisionSIGSTOP(t *testing.T) {
	t.Parallel()
	w := newSupWorld(t)
	db := "sqlite:" + filepath.Join(w.dir, "locks.db")
	r1 := w.run("a", "ignore", db)
	w.waitStarted("a", 10*time.Second)
	require.NoError(t, r1.Process.Signal(syscall.SIGSTOP))
	stopped := time.Now()
	time.Sleep(20 * time.Millisecond) // a renewal in flight lands first
	dl := w.dbDeadline(db, "sup")
	w.run("b", "term", db, "--wait", "20s")
	gone := w.waitGone("a", 2*supTTL)
	require.True(t, gone.Before(dl), "the command was gone at %v, after the lease's database deadline %v", gone, dl)
	w.waitStarted("b", 10*time.Second)
	require.NoError(t, r1.Process.Signal(syscall.SIGCONT))
	require.Equal(t, 76, exitCode(t, r1, 10*time.Second))
	// It says what it knows: no renewal succeeded before the local
	// deadline; not that the database could not be reached.
	out, _ := os.ReadFile(filepath.Join(w.dir, "a.out"))
	require.Contains(t, string(out), "its local deadline passed without a successful renewal")
	require.NotContains(t, string(out), "could not be reached")
	gaps := w.checkNoOverlap()
	t.Logf("figures: SIGSTOP of sqllock run (TTL %v, TERM ignored): command killed %v after the stop, %v before the database deadline; next holder started %v after",
		supTTL, gone.Sub(stopped).Round(time.Millisecond), dl.Sub(gone).Round(time.Millisecond), gaps[0].Round(time.Millisecond))
}

// A database sqllock can no longer reach (PostgreSQL behind a black-holing
// proxy) while the command ignores SIGTERM: SIGKILL lands at the local
// deadline, before the database deadline, and the next holder (connected
// directly) never overlaps it.
func TestSupervisionOutage(t *testing.T) {
	t.Parallel()
	pg := pgtest.New(t)
	migrateUp(context.Background(), t, pg)
	u, err := url.Parse(pg.URL)
	require.NoError(t, err)
	p, err := faultproxy.New(u.Host)
	require.NoError(t, err)
	t.Cleanup(func() { _ = p.Close() })
	u.Host = p.Addr()
	w := newSupWorld(t)
	w.run("a", "ignore", u.String())
	w.waitStarted("a", 10*time.Second)
	p.Set(faultproxy.Blackhole)
	cut := time.Now()
	dl := w.dbDeadline(pg.URL, "sup")
	w.run("b", "term", pg.URL, "--wait", "20s")
	gone := w.waitGone("a", 2*supTTL)
	require.True(t, gone.Before(dl), "the command was gone at %v, after the lease's database deadline %v", gone, dl)
	w.waitStarted("b", 10*time.Second)
	gaps := w.checkNoOverlap()
	// SIGTERM came before the local deadline, and sqllock said why (its
	// release, through the black hole, is left to time out).
	out, _ := os.ReadFile(filepath.Join(w.dir, "a.out"))
	require.Contains(t, string(out), "was not renewed in time")
	t.Logf("figures: database outage under sqllock run (TTL %v, TERM ignored): command killed %v after the cut, %v before the database deadline; next holder started %v after",
		supTTL, gone.Sub(cut).Round(time.Millisecond), dl.Sub(gone).Round(time.Millisecond), gaps[0].Round(time.Millisecond))
}

// `sqllock elect` with the leader's sqllock SIGKILLed three times (its
// command left alone): never two commands at once.
func TestSupervisionElectKill9(t *testing.T) {
	t.Parallel()
	w := newSupWorld(t)
	db := "sqlite:" + filepath.Join(w.dir, "locks.db")
	cands := map[string]*exec.Cmd{}
	for i := range 4 {
		id := fmt.Sprintf("c%d", i+1)
		cands[id] = w.start(id, "elect", "--name", "sup", "--ttl", supTTL.String(), "--grace", supGrace.String(),
			"--database-url", db, "--", "sh", "job.sh", id, "term")
	}
	var took []string
	for round := 1; round <= 4; round++ {
		deadline := time.Now().Add(10 * time.Second)
		var ids []string
		for ids, _ = w.starts(); len(ids) < round; ids, _ = w.starts() {
			if time.Now().After(deadline) {
				t.Fatalf("round %d: no new leader within 10s; starts %v", round, ids)
			}
			time.Sleep(5 * time.Millisecond)
		}
		require.Len(t, ids, round, "more leaders than rounds")
		leader := ids[round-1]
		w.waitStarted(leader, 5*time.Second)
		if round == 4 {
			break
		}
		killed := time.Now()
		require.NoError(t, cands[leader].Process.Kill())
		took = append(took, w.waitGone(leader, 5*time.Second).Sub(killed).Round(time.Millisecond).String())
	}
	w.checkNoOverlap()
	t.Logf("figures: elect, leader's sqllock SIGKILLed 3 times (TTL %v): commands gone after [%s]; overlaps=0", supTTL, strings.Join(took, " "))
}
