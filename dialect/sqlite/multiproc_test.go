//go:build unix

package sqlite

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ashlock/ashlock/sqllock"
)

// The multi-process tests (TestMultiProcess*) re-execute the test binary
// as child processes; TestMain hands a child to helperMain when helperEnv is
// set. A child opens the shared file with Open (the library's defaults:
// FULL, 10 ms busy timeout, the backend's own busy retry) and loops:
//
//	acquire "k" (polling while held) → fenced read-modify-write of the
//	counter (one UPDATE whose trigger appends to the audit table, in commit
//	order) → release.
//
// It writes a JSON report to the file named in the environment.
const (
	helperEnv = "ASHLOCK_SQLITE_HELPER" // JSON-encoded helperConfig
	lockKey   = "k"
)

type helperConfig struct {
	Path   string        // database file
	Out    string        // report file
	Proc   int           // process number
	Cycles int           // cycles to complete
	TTL    time.Duration // lease TTL
	// HoldAt, if > 0: on this (1-based) completed cycle, after acquiring, begin a write
	// transaction on the counter, print "holding <token> <deadline ms>" on
	// stdout and block until killed (SQ-1k).
	HoldAt int
	// Until, if set: keep cycling past Cycles until this file exists and
	// this process was granted a token above the one the file holds.
	Until string
}

type grant struct {
	Token      int64
	BackendMS  int64 // SQLite's now at the grant
	DeadlineMS int64
	Start, End int64 // CLOCK_MONOTONIC ns: after acquire, before release
}

type helperReport struct {
	Proc        int
	Cycles      int
	Elapsed     time.Duration
	BusyRetries uint64 // absorbed by the backend (Stats)
	AppBusy     int    // absorbed by the child's own counter write
	NotAcquired int    // polls that found the key held
	Unavailable int    // ErrUnavailable returned (retried by the child)
	Stale       int    // fenced writes refused: must be 0
	Lost        int    // releases that reported a lost lease: must be 0
	RawBusy     int    // SQLITE_BUSY that reached the child raw: must be 0
	OtherErrors []string
	Grants      []grant
}

func monotonicNow() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		panic(err)
	}
	return ts.Nano()
}

func helperMain() int {
	var cfg helperConfig
	if err := json.Unmarshal([]byte(os.Getenv(helperEnv)), &cfg); err != nil {
		fmt.Fprintln(os.Stderr, "helper config:", err)
		return 2
	}
	rep, err := runHelper(cfg)
	if err != nil {
		rep.OtherErrors = append(rep.OtherErrors, err.Error())
	}
	data, _ := json.Marshal(rep)
	if err := os.WriteFile(cfg.Out, data, 0o644); err != nil {
		fmt.Fprintln(os.Stderr, "helper report:", err)
		return 2
	}
	return 0
}

func runHelper(cfg helperConfig) (rep helperReport, err error) {
	rep.Proc = cfg.Proc
	b, err := Open(cfg.Path, Options{})
	if err != nil {
		return rep, err
	}
	defer b.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	start := time.Now()
	defer func() {
		rep.Elapsed = time.Since(start)
		rep.BusyRetries = b.Stats().BusyRetries
	}()
	more := func() bool {
		if rep.Cycles < cfg.Cycles {
			return true
		}
		if cfg.Until == "" {
			return false
		}
		data, err := os.ReadFile(cfg.Until)
		if err != nil {
			return true
		}
		above, err := strconv.ParseInt(string(data), 10, 64)
		return err != nil || len(rep.Grants) == 0 || rep.Grants[len(rep.Grants)-1].Token <= above
	}
	for cycle := 1; more(); cycle++ {
		if ctx.Err() != nil {
			return rep, fmt.Errorf("gave up after %d cycles: %w", rep.Cycles, ctx.Err())
		}
		req := sqllock.AcquireRequest{Key: lockKey, TTL: cfg.TTL, Owner: fmt.Sprintf("p%d-c%d", cfg.Proc, cycle)}
		l, err := b.TryAcquire(ctx, req)
		var he *sqllock.HeldError
		switch {
		case errors.As(err, &he):
			rep.NotAcquired++
			// Poll: a short jittered sleep, never past the holder's
			// remaining lease.
			time.Sleep(min(he.Remaining, 500*time.Microsecond+rand.N(2*time.Millisecond)))
			continue
		case errors.Is(err, sqllock.ErrUnavailable):
			rep.Unavailable++
			continue
		case err != nil && isBusy(err):
			rep.RawBusy++
			continue
		case err != nil:
			return rep, fmt.Errorf("acquire: %w", err)
		}
		g := grant{Token: l.Token, BackendMS: l.BackendTime.UnixMilli(), DeadlineMS: l.Deadline.UnixMilli(), Start: monotonicNow()}

		if rep.Cycles+1 == cfg.HoldAt {
			// Die holding the lease and, in the middle of a write, the
			// SQLite write lock.
			for {
				tx, err := b.db.BeginTx(ctx, nil) // BEGIN IMMEDIATE
				if err == nil {
					_, err = tx.ExecContext(ctx, `UPDATE counter SET n = n + 1000000, fence = ?1 WHERE id = 1 AND fence <= ?1`, l.Token)
					if err != nil {
						tx.Rollback()
					}
				}
				if isBusy(err) {
					rep.AppBusy++
					time.Sleep(rand.N(2 * time.Millisecond))
					continue
				}
				if err != nil {
					return rep, err
				}
				break
			}
			fmt.Printf("holding %d %d\n", l.Token, g.DeadlineMS)
			select {} // until SIGKILL
		}

		// The fenced read-modify-write: applies only if no newer token
		// wrote first. The trigger appends (token, n) to the audit table in
		// the same statement, so audit order is commit order.
		for {
			res, err := b.db.ExecContext(ctx, `UPDATE counter SET n = n + 1, fence = ?1 WHERE id = 1 AND fence <= ?1`, l.Token)
			if isBusy(err) {
				rep.AppBusy++
				time.Sleep(rand.N(2 * time.Millisecond))
				continue
			}
			if err != nil {
				return rep, fmt.Errorf("counter: %w", err)
			}
			if n, _ := res.RowsAffected(); n != 1 {
				rep.Stale++
			}
			break
		}
		g.End = monotonicNow()
		for {
			err = b.Release(ctx, l)
			if errors.Is(err, sqllock.ErrUnavailable) {
				rep.Unavailable++
				continue
			}
			break
		}
		switch {
		case errors.Is(err, sqllock.ErrLeaseLost):
			rep.Lost++
		case err != nil && isBusy(err):
			rep.RawBusy++
		case err != nil:
			return rep, fmt.Errorf("release: %w", err)
		}
		rep.Grants = append(rep.Grants, g)
		rep.Cycles++
	}
	return rep, nil
}

// setupShared creates the shared file: the lock table (via Open) and the
// counter with its audit trigger.
func setupShared(t *testing.T) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), "shared.db")
	b, err := Open(path, Options{})
	require.NoError(t, err)
	defer b.Close()
	_, err = b.db.ExecContext(testCtx(t), `
CREATE TABLE counter (id INTEGER PRIMARY KEY, n INTEGER NOT NULL, fence INTEGER NOT NULL);
INSERT INTO counter VALUES (1, 0, 0);
CREATE TABLE audit (seq INTEGER PRIMARY KEY AUTOINCREMENT, token INTEGER NOT NULL, n INTEGER NOT NULL);
CREATE TRIGGER counter_audit AFTER UPDATE ON counter BEGIN
	INSERT INTO audit (token, n) VALUES (NEW.fence, NEW.n);
END;`)
	require.NoError(t, err)
	return path
}

type child struct {
	cfg    helperConfig
	cmd    *exec.Cmd
	stdout *bufio.Reader
}

func startChild(t *testing.T, ctx context.Context, cfg helperConfig) *child {
	t.Helper()
	cfg.Out = filepath.Join(t.TempDir(), fmt.Sprintf("report-%d.json", cfg.Proc))
	env, err := json.Marshal(cfg)
	require.NoError(t, err)
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), helperEnv+"="+string(env))
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	c := &child{cfg: cfg, cmd: cmd, stdout: bufio.NewReader(out)}
	return c
}

func (c *child) wait(t *testing.T) helperReport {
	t.Helper()
	require.NoError(t, c.cmd.Wait(), "child %d", c.cfg.Proc)
	data, err := os.ReadFile(c.cfg.Out)
	require.NoError(t, err)
	var rep helperReport
	require.NoError(t, json.Unmarshal(data, &rep))
	return rep
}

// checkShared verifies the file after the children: integrity, the counter
// equals the completed cycles, and audit tokens strictly increase in commit
// order. It returns the audit tokens.
func checkShared(t *testing.T, path string, wantCount int) []int64 {
	t.Helper()
	b, err := Open(path, Options{}) // opens cleanly (WAL recovery after a kill)
	require.NoError(t, err)
	defer b.Close()
	ctx := testCtx(t)
	var integrity string
	require.NoError(t, b.db.QueryRowContext(ctx, `PRAGMA integrity_check`).Scan(&integrity))
	require.Equal(t, "ok", integrity)
	var n int
	require.NoError(t, b.db.QueryRowContext(ctx, `SELECT n FROM counter WHERE id = 1`).Scan(&n))
	require.Equal(t, wantCount, n, "counter = Σ completed cycles (no lost update, no partial write)")
	rows, err := b.db.QueryContext(ctx, `SELECT token, n FROM audit ORDER BY seq`)
	require.NoError(t, err)
	defer rows.Close()
	var tokens []int64
	for i := 1; rows.Next(); i++ {
		var tok int64
		var an int
		require.NoError(t, rows.Scan(&tok, &an))
		require.Equal(t, i, an, "audit row %d", i)
		if len(tokens) > 0 {
			require.Greater(t, tok, tokens[len(tokens)-1], "tokens must strictly increase in commit order")
		}
		tokens = append(tokens, tok)
	}
	require.NoError(t, rows.Err())
	return tokens
}

// checkDisjoint: the critical sections (monotonic clock, shared by all
// processes of the host) never overlap.
func checkDisjoint(t *testing.T, reps []helperReport) {
	t.Helper()
	var all []grant
	for _, r := range reps {
		all = append(all, r.Grants...)
	}
	slices.SortFunc(all, func(a, b grant) int { return int(a.Start - b.Start) })
	for i := 1; i < len(all); i++ {
		require.Less(t, all[i-1].End, all[i].Start, "critical sections of tokens %d and %d overlap", all[i-1].Token, all[i].Token)
		require.Greater(t, all[i].Token, all[i-1].Token)
	}
}

// TestMultiProcessContention is SQ-1: 4 processes, 150 cycles each, on one
// key of one file.
func TestMultiProcessContention(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns processes")
	}
	t.Parallel()
	const procs, cycles = 4, 150
	path := setupShared(t)
	// The parent's kill bound, above the children's own 60 s limit, so
	// that a slow child reports instead of being killed. Fairness is
	// judged by every child finishing all its cycles, not by a wall-clock
	// figure on a shared machine (logged below; about 1.5-5 s here).
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	start := time.Now()
	var children []*child
	for p := range procs {
		// TTL 10 s: a hold lasts milliseconds; the TTL only has to outlast
		// a child descheduled for a while, which must not count as a loss.
		children = append(children, startChild(t, ctx, helperConfig{Path: path, Proc: p, Cycles: cycles, TTL: 10 * time.Second}))
	}
	var reps []helperReport
	total := 0
	for _, c := range children {
		r := c.wait(t)
		reps = append(reps, r)
		total += r.Cycles
		t.Logf("proc %d: %d cycles in %v; busy retries absorbed by the backend %d, by the counter write %d; polls refused %d; unavailable %d",
			r.Proc, r.Cycles, r.Elapsed.Round(time.Millisecond), r.BusyRetries, r.AppBusy, r.NotAcquired, r.Unavailable)
		require.Empty(t, r.OtherErrors, "proc %d", r.Proc)
		require.Equal(t, cycles, r.Cycles, "proc %d starved", r.Proc)
		require.Zero(t, r.RawBusy, "proc %d saw raw SQLITE_BUSY", r.Proc)
		require.Zero(t, r.Stale, "proc %d: fenced writes refused", r.Proc)
		require.Zero(t, r.Lost, "proc %d: leases lost", r.Proc)
	}
	t.Logf("%d processes × %d cycles = %d fenced cycles in %v (%.0f cycles/s)",
		procs, cycles, total, time.Since(start).Round(time.Millisecond), float64(total)/time.Since(start).Seconds())
	tokens := checkShared(t, path, total)
	require.Len(t, tokens, total)
	checkDisjoint(t, reps)
}

// TestMultiProcessKillHolder is SQ-1k: a child is SIGKILLed while it holds
// the lease and, in the middle of a write transaction, SQLite's write lock.
// The others take the key only after the lease's deadline, the unfinished
// write is absent, and the file opens cleanly.
func TestMultiProcessKillHolder(t *testing.T) {
	if testing.Short() {
		t.Skip("spawns processes")
	}
	t.Parallel()
	// TTL 4 s: long enough that a survivor descheduled for a while keeps
	// its lease (renewed every 1.3 s); the takeover waits out one TTL.
	const survivors, cycles, ttl = 3, 40, 4 * time.Second
	path := setupShared(t)
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()

	// The survivors cycle until the victim is dead and each has held the
	// key after it, so that they are waiting when it dies.
	killed := filepath.Join(t.TempDir(), "killed")
	victim := startChild(t, ctx, helperConfig{Path: path, Proc: 0, Cycles: 1000, TTL: ttl, HoldAt: 10})
	var children []*child
	for p := 1; p <= survivors; p++ {
		children = append(children, startChild(t, ctx, helperConfig{Path: path, Proc: p, Cycles: cycles, TTL: ttl, Until: killed}))
	}
	line, err := victim.stdout.ReadString('\n')
	require.NoError(t, err, "victim never reported holding")
	f := strings.Fields(line)
	require.Len(t, f, 3, line)
	victimToken, _ := strconv.ParseInt(f[1], 10, 64)
	victimDeadline, _ := strconv.ParseInt(f[2], 10, 64)
	require.NoError(t, victim.cmd.Process.Signal(syscall.SIGKILL))
	killedAt := time.Now()
	err = victim.cmd.Wait()
	var exitErr *exec.ExitError
	require.ErrorAs(t, err, &exitErr)
	require.NoError(t, os.WriteFile(killed, []byte(strconv.FormatInt(victimToken, 10)), 0o644))

	var reps []helperReport
	total := 0
	var next *grant
	for _, c := range children {
		r := c.wait(t)
		reps = append(reps, r)
		total += r.Cycles
		require.Empty(t, r.OtherErrors, "proc %d", r.Proc)
		require.GreaterOrEqual(t, r.Cycles, cycles, "proc %d", r.Proc)
		require.Zero(t, r.RawBusy)
		require.Zero(t, r.Stale)
		require.Zero(t, r.Lost)
		t.Logf("proc %d: %d cycles in %v; busy retries %d (+%d counter); polls refused %d; unavailable %d",
			r.Proc, r.Cycles, r.Elapsed.Round(time.Millisecond), r.BusyRetries, r.AppBusy, r.NotAcquired, r.Unavailable)
		for _, g := range r.Grants {
			if g.Token == victimToken+1 {
				next = &g
			}
		}
	}
	require.NotNil(t, next, "nobody took over token %d", victimToken)
	require.GreaterOrEqual(t, next.BackendMS, victimDeadline, "taken over before the killed holder's deadline")
	// G5: within TTL + a poll interval + a round trip of the crash. The
	// waiters poll every 0.5-2.5 ms (never past the holder's remaining
	// lease), so the takeover comes within one poll of the deadline plus
	// an allowance of 400 ms for the round trip, the recovery of the write
	// lock the victim died holding, and scheduling on a loaded 2-core
	// machine. Measured: at most 24 ms over 5 idle runs, 114 ms over 3 runs
	// under -race on a machine with a load average of 15.
	const takeoverBound = 2500*time.Microsecond + 400*time.Millisecond
	require.LessOrEqual(t, next.BackendMS-victimDeadline, takeoverBound.Milliseconds(), "takeover %d ms after the deadline; bound %v", next.BackendMS-victimDeadline, takeoverBound)
	t.Logf("victim token %d killed %v before its deadline; takeover %d ms after the deadline (TTL %v)",
		victimToken, time.Duration(victimDeadline-killedAt.UnixMilli())*time.Millisecond, next.BackendMS-victimDeadline, ttl)

	// The victim completed 9 cycles; its tenth write (+1000000) never
	// committed.
	tokens := checkShared(t, path, total+9)
	require.NotContains(t, tokens, victimToken)
	checkDisjoint(t, reps)
}
