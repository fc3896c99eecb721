package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

const runUsage = `
Usage: sqllock run --key KEY [--permits N | --shared] [--ttl 30s] [--wait 0] [--grace 10s] [--max-hold D] [flags] -- COMMAND [ARGS...]

Runs COMMAND while holding the lock KEY, and releases it when COMMAND exits.

  1. Acquires KEY: one attempt with --wait 0 (the default), else waiting up
     to --wait for the current holder to finish. With --permits N, KEY is
     a semaphore of N permits and run takes any free one: at most N
     COMMANDs run at once. A permit is a lease of its own, under the key
     KEY#permit-I with its own tokens; SQLLOCK_KEY names it. N is stored
     with KEY by its first run: another N is refused (exit 78). With
     --shared, run takes KEY shared: any number of shared runs hold it at
     once, never beside an exclusive one; a waiting exclusive run keeps
     new shared ones out (docs/shared-locks.md). SQLLOCK_KEY names its
     reader slot, KEY#shared-I.
  2. Starts COMMAND with stdin, stdout and stderr passed through and these
     variables added to its environment:
       SQLLOCK_KEY    the key
       SQLLOCK_TOKEN  the fencing token: larger than every earlier holder's.
                      Pass it to the resource you protect, and have it refuse
                      writes carrying a token lower than one it has seen.
       SQLLOCK_OWNER  this lease's owner, as "sqllock list" shows it
  3. Renews the lease in the background every --ttl/3.
     With --min-hold D, KEY stays held until D after the grant (by the
     database clock) even when COMMAND exits sooner or sqllock dies: a
     second crontab firing the same job seconds later skips it.
     With --max-hold D, a COMMAND that hangs is stopped D after the
     acquire, as timeout(1) would: SIGTERM, SIGKILL --grace later (at
     most ttl/3), and sqllock exits 124. The lease is renewed until the
     SIGKILL and no longer: it is held at most D + that grace.
  4. SIGINT and SIGTERM sent to sqllock are forwarded to COMMAND, and sqllock
     waits for it to exit.
  5. COMMAND is not running after the lease's local deadline, whether
     sqllock is killed, paused, or cut off from the database: a small
     supervising process (sqllock itself) starts COMMAND in its own process
     group, learns every renewed local deadline, and SIGKILLs the group at
     it. While renewals fail it sends SIGTERM first, --grace before the
     deadline (at most a third of the TTL; at once if less is left), and at once
     if sqllock dies. A loss that is already final ("sqllock release
     --force", a newer token) stops COMMAND once the next renewal finds it
     (at most a third of the TTL later): SIGTERM, SIGKILL after --grace;
     only then can COMMAND overlap the next holder. sqllock exits
     76 when COMMAND was stopped. Signals reach the processes COMMAND
     started too (forwarded signals go to the group as well, followed by
     SIGCONT so that a stopped process acts on them); on Linux also those
     that left the group.
  6. With --log-format json (or text), sqllock writes its own lines to
     stderr as log records, one per line, with the lock's history: acquired
     (key, token, owner, backend, attempts, wait), renewals and attempts
     (--log-level debug), the command's exit status, released (held), and
     a loss (WARN, with its reason): a cron job's lock history for the log
     pipeline. Durations are nanoseconds in JSON.
  7. When stdin is the terminal, COMMAND's group is made the terminal's
     foreground, as a shell does for a job: an interactive COMMAND can read
     it, and Ctrl-C reaches it directly. On Linux, Ctrl-Z stops COMMAND and
     then sqllock, and fg continues both (a stop longer than the lease
     loses the lock, and COMMAND is then stopped as after any loss).

Exit status: COMMAND's own (128+N if it died by signal N), except
  75   not acquired: KEY is held by another (or --wait elapsed), or the
       lease was lost before COMMAND started; COMMAND was not started
       (--conflict-exit-code N: N instead)
  76   the lease was lost while COMMAND ran; COMMAND was stopped (this wins
       over COMMAND's own status: its work may have overlapped another
       holder's)
  124  COMMAND reached --max-hold and was stopped (the lease was held
       until then)
  64   usage error; 69 database unreachable (with --wait, only once the
       wait is spent trying to connect); 78 configuration error: bad URL,
       password or user refused, database missing, lock table missing
       (PostgreSQL: run "sqllock migrate up"), or a SQLite file that is
       read-only, not a database or in a missing directory
  A COMMAND that exits 75 or 76 itself looks like these: choose a
  --conflict-exit-code that COMMAND never uses (like flock -E), and tell a
  loss by sqllock's own message on stderr (or --log-format json).
  126  COMMAND could not be started; 127 COMMAND not found

Examples:
  sqllock run --key nightly-report -- ./report.sh --since yesterday
  sqllock run --key deploy --wait 5m --ttl 1m -- make deploy
  sqllock run --key hourly --min-hold 1m -- ./hourly.sh   # every host's crontab: runs once an hour
  sqllock run --key nightly --max-hold 2h -- ./nightly.sh  # a nightly job that hangs is stopped at 2h
  sqllock run --key demo -- sh -c 'echo "token $SQLLOCK_TOKEN"'
  sqllock run --key reports --permits 4 --wait 10m -- ./report.sh   # at most 4 at once
  sqllock run --key nightly --log-format json -- ./nightly.sh 2>>/var/log/nightly.jsonl
`

// Default timings of `run`.
const (
	// minRunTTL is the shortest --ttl: below it a renewal round trip (every
	// ttl/3) cannot be relied on to land before the lease expires.
	minRunTTL    = time.Second
	defaultGrace = 10 * time.Second
	// releaseTimeout bounds the release after COMMAND exited; the lease
	// expires by itself anyway.
	releaseTimeout = 5 * time.Second
)

type runFlags struct {
	db         dbFlags
	log        logFlags
	key        string
	ttl, wait  time.Duration
	grace      time.Duration
	minHold    time.Duration
	maxHold    time.Duration // 0: none
	command    []string
	commandRaw string // COMMAND as given, for messages
	// waitLeft is what is left of --wait after connecting.
	waitLeft time.Duration
	// attemptTimeout bounds the single acquire attempt of --wait 0 (0: no
	// bound).
	attemptTimeout time.Duration
	// conflictCode is the exit status for "not acquired"
	// (--conflict-exit-code).
	conflictCode int
	// permits, when not zero, makes KEY a semaphore of that many permits
	// (--permits): run takes one of them (permits.go).
	permits int
	// shared takes KEY shared (--shared).
	shared bool
}

func cmdRun(ctx context.Context, e *env, args []string) error {
	var f runFlags
	fs := e.flagSet("run", runUsage)
	fs.StringVar(&f.key, "key", "", "the lock's `key` (required)")
	durationVar(fs, &f.ttl, "ttl", sqllock.DefaultTTL, "lease duration, at least 1s; renewed every ttl/3 while COMMAND runs")
	durationVar(fs, &f.wait, "wait", 0, "how long to wait for the lock; 0 means one attempt")
	durationVar(fs, &f.minHold, "min-hold", 0, "keep KEY held at least this long after the grant, by the database clock, even when COMMAND ends sooner (0: no minimum)")
	durationVar(fs, &f.maxHold, "max-hold", 0, "stop COMMAND this long after the acquire (SIGTERM, SIGKILL --grace later, at most ttl/3) and exit 124; 0: no maximum")
	durationVar(fs, &f.grace, "grace", defaultGrace, "time between SIGTERM and SIGKILL when COMMAND is stopped")
	fs.IntVar(&f.conflictCode, "conflict-exit-code", ExitTempFail, "exit status when the lock is not acquired (0 to 255), to tell it from a COMMAND that exits 75 itself")
	fs.BoolVar(&e.quiet, "quiet", false, "with --wait, do not print who holds the key while waiting")
	fs.IntVar(&f.permits, "permits", 0, "make KEY a semaphore of `N` permits and take one: at most N commands run at once (0: a lock)")
	fs.BoolVar(&f.shared, "shared", false, "take KEY shared (a reader): shared runs hold it together, never beside an exclusive run")
	err := e.parseCommandLine(fs, args, &f, "key", &f.key, func(k string) string { return k },
		func() error { return checkCommandTTL(f.ttl, "lease") }, f.checkDurations, f.checkPermits,
		func() error { return checkConflictCode(f.conflictCode) })
	if err != nil {
		return err
	}

	// Signals are ours from here on: during the acquire they end the wait;
	// while COMMAND runs they are forwarded to it.
	sigs := make(chan os.Signal, 8)
	e.notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer e.stopNotify(sigs)

	// --wait bounds everything before COMMAND starts: connecting included.
	// Without --wait, the one attempt is bounded by the connect timeout
	// (PostgreSQL; SQLite bounds its own waits).
	start := time.Now()
	openCtx, cancelOpen := ctx, context.CancelFunc(func() {})
	if f.wait > 0 {
		openCtx, cancelOpen = context.WithDeadline(ctx, start.Add(f.wait))
	}
	e.waitProgress = f.wait > 0
	s, err := e.open(openCtx, f.db, openOptions{maxConns: 4, client: func(d *database) sqllock.Options {
		return e.withWaitProgress(e.clientOptions(f.ttl, d))
	}})
	cancelOpen()
	if err != nil {
		return err
	}
	defer s.close()
	if f.wait > 0 {
		f.waitLeft = max(time.Until(start.Add(f.wait)), time.Millisecond)
	} else if t := s.db.connectTimeout(); t > 0 {
		f.attemptTimeout = t
	}
	g, err := e.acquire(ctx, s.client, f, sigs)
	if err != nil {
		return s.db.opError(err, f.db)
	}
	return e.supervise(guardTenure(g, g.Key()), f, sigs) // g.Key(): KEY, or the permit's key
}

// checkDurations checks run's durations: none negative, and a --max-hold
// the Guard can keep.
func (f *runFlags) checkDurations() error {
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"wait", f.wait}, {"grace", f.grace}, {"min-hold", f.minHold}, {"max-hold", f.maxHold}} {
		if err := nonNegative(d.name, d.v); err != nil {
			return err
		}
	}
	if f.maxHold > 0 && f.maxHold < sqllock.MinInterval {
		return fail(ExitUsage, "--max-hold %s: must be 0 (none) or at least %s", fmtDuration(f.maxHold), fmtDuration(sqllock.MinInterval))
	}
	return nil
}

// parseCommandLine parses the flags of run or elect, which run COMMAND
// under a lease, and checks them before any I/O: the flag keyFlag (its
// value *given) names the lease's key, key(*given); checks follow, in
// order, and COMMAND is looked up last.
func (e *env) parseCommandLine(fs *flag.FlagSet, args []string, f *runFlags, keyFlag string, given *string, key func(string) string, checks ...func() error) error {
	f.db.register(fs)
	f.log.register(fs)
	if err := e.parse(fs, args); err != nil {
		return err
	}
	if err := f.log.setup(e); err != nil {
		return err
	}
	f.command = fs.Args()
	switch {
	case *given == "":
		return fail(ExitUsage, "missing --%s (see %s --help)", keyFlag, fs.Name())
	case len(f.command) == 0:
		return fail(ExitUsage, "missing the command to run after -- (see %s --help)", fs.Name())
	}
	f.key = key(*given)
	if err := sqllock.ValidateKey(f.key); err != nil {
		return fail(ExitUsage, "--%s: %v", keyFlag, err)
	}
	for _, check := range checks {
		if err := check(); err != nil {
			return err
		}
	}
	return f.resolveCommand()
}

// checkCommandTTL checks the --ttl of a lease (or term) that COMMAND runs
// under: at least minRunTTL, so that it can be renewed every ttl/3.
func checkCommandTTL(ttl time.Duration, what string) error {
	if ttl < minRunTTL && ttl >= sqllock.MinTTL {
		return fail(ExitUsage, "--ttl %s is too short: at least %s, so that the %s can be renewed (every ttl/3) while COMMAND runs", fmtDuration(ttl), fmtDuration(minRunTTL), what)
	}
	return checkTTL(ttl, minRunTTL, sqllock.MaxTTL)
}

// resolveCommand finds COMMAND before any I/O: not found is 127, found
// but not executable 126.
func (f *runFlags) resolveCommand() error {
	f.commandRaw = f.command[0]
	path, err := exec.LookPath(f.command[0])
	if err != nil {
		code := ExitNotFound
		if !errors.Is(err, exec.ErrNotFound) && !errors.Is(err, os.ErrNotExist) {
			code = ExitCannotExec
		}
		return fail(code, "command %q: %v", f.command[0], err)
	}
	f.command[0] = path
	return nil
}

// errAttemptTimeout ends an acquire attempt that got no answer in time.
type errAttemptTimeout struct{ d time.Duration }

func (e errAttemptTimeout) Error() string { return fmt.Sprintf("no answer within %v", e.d) }

// beforeStart, when set (by tests), runs between the acquire and COMMAND's
// start.
var beforeStart func()

// signalExit is how the acquire was interrupted.
type signalExit struct{ sig os.Signal }

func (s signalExit) Error() string { return fmt.Sprintf("interrupted by %v", s.sig) }

func signalNumber(sig os.Signal) int {
	if s, ok := sig.(syscall.Signal); ok {
		return int(s)
	}
	return 2
}

// acquire takes the lock, ending early on a signal or when ctx ends. The
// Guard's context does not derive from ctx: after the acquire, signals are
// forwarded to COMMAND and must not end the lease under it.
func (e *env) acquire(ctx context.Context, client *sqllock.Client, f runFlags, sigs <-chan os.Signal) (*sqllock.Guard, error) {
	lockCtx, cancel := context.WithCancelCause(context.WithoutCancel(ctx))
	attemptEnd := time.Now().Add(f.attemptTimeout)
	stopWatch := watchAcquire(ctx, cancel, f.attemptTimeout, sigs)
	var (
		g   *sqllock.Guard
		err error
	)
	opts := &sqllock.AcquireOptions{TTL: f.ttl, MinHold: f.minHold}
	if f.maxHold > 0 {
		// The lease is held through the SIGKILL: the supervisor sends
		// SIGTERM termLead before the local deadline, which the Guard
		// caps here, so COMMAND gets SIGTERM at --max-hold.
		opts.MaxHold = f.maxHold + termLead(f)
	}
	if f.wait > 0 {
		opts.Wait = f.waitLeft
	}
	g, err = f.take(lockCtx, client, opts)
	stopWatch()
	if f.attemptTimeout > 0 && lockCtx.Err() == nil && !time.Now().Before(attemptEnd) {
		// The backend's own bounds (its first round trip's) may end
		// the attempt at the same moment, a little before the watcher
		// is served: past its end, the attempt timed out, whichever
		// noticed first. (lockCtx is the Guard's parent, so the bound
		// cannot be its deadline.)
		cancel(errAttemptTimeout{f.attemptTimeout})
	}
	if cause := context.Cause(lockCtx); cause != nil {
		// Interrupted: give the lease back, if the acquire won it.
		if g != nil {
			rctx, cancelRelease := context.WithTimeout(context.Background(), releaseTimeout)
			_ = g.Release(rctx)
			cancelRelease()
		}
		return nil, interruptedAcquire(cause, f.key)
	}
	if err != nil {
		return nil, acquireError(err, f)
	}
	return g, nil
}

// watchAcquire ends an acquire, through cancel, on a signal, when ctx
// ends, or when the attempt timeout (if any) passes; the function it
// returns stops watching, once the acquire has returned.
func watchAcquire(ctx context.Context, cancel context.CancelCauseFunc, timeout time.Duration, sigs <-chan os.Signal) func() {
	acquired := make(chan struct{})
	watcherDone := make(chan struct{})
	var attemptTimeout <-chan time.Time
	var t *time.Timer
	if timeout > 0 {
		t = time.NewTimer(timeout)
		attemptTimeout = t.C
	}
	go func() {
		defer close(watcherDone)
		select {
		case <-acquired:
		case <-attemptTimeout:
			cancel(errAttemptTimeout{timeout})
		case s := <-sigs:
			cancel(signalExit{s})
		case <-ctx.Done():
			if s := signalSoon(sigs); s != nil {
				cancel(signalExit{s})
			} else {
				cancel(context.Cause(ctx))
			}
		}
	}()
	return func() {
		close(acquired)
		<-watcherDone
		if t != nil {
			t.Stop()
		}
	}
}

// signalSoon is the signal that arrives within 50ms, or nil. main's
// NotifyContext ends ctx on a signal too; the signal itself, which
// arrives at the same moment, says more.
func signalSoon(sigs <-chan os.Signal) os.Signal {
	t := time.NewTimer(50 * time.Millisecond)
	defer t.Stop()
	select {
	case s := <-sigs:
		return s
	case <-t.C:
		return nil
	}
}

// interruptedAcquire is run's error for an acquire that cause ended.
func interruptedAcquire(cause error, key string) error {
	var se signalExit
	var te errAttemptTimeout
	if errors.As(cause, &te) {
		return fail(ExitUnavailable, "acquire %q: no answer from the database within %v (--connect-timeout); not run", key, te.d)
	}
	if errors.As(cause, &se) {
		return fail(exitSignalBase+signalNumber(se.sig), "%v while acquiring %q; not run", se.sig, key)
	}
	return fail(exitSignalBase+2, "interrupted while acquiring %q (%v); not run", key, cause)
}

// acquireError is run's error for an acquire that failed: not acquired
// (--conflict-exit-code) with who holds the key, or what went wrong.
func acquireError(err error, f runFlags) error {
	if perr := permitsError(err, f); perr != nil {
		return perr
	}
	if errors.Is(err, sqllock.ErrSharedUnsupported) {
		return fail(ExitConfig, "--shared: this database's backend does not support shared locks (SQLite and PostgreSQL do); not run")
	}
	var he *sqllock.HeldError
	if errors.As(err, &he) {
		msg := fmt.Sprintf("not acquired: %q is held", f.key)
		switch {
		case he.WaitingWriter != "" && he.Owner == "":
			msg = fmt.Sprintf("not acquired: writer %q waits for %q", he.WaitingWriter, f.key)
		case he.Shared > 0:
			msg += fmt.Sprintf(" shared by %d holders, the last for %v more at most", he.Shared, he.Remaining.Round(time.Millisecond))
		}
		if he.Owner != "" {
			msg += fmt.Sprintf(" by %q (token %d) for %v more", he.Owner, he.Token, he.Remaining.Round(time.Millisecond))
		}
		if f.wait == 0 {
			msg += "; use --wait DURATION to wait for it"
		} else {
			msg += fmt.Sprintf("; gave up after waiting %v", f.wait)
		}
		return fail(f.conflictCode, "%s", msg)
	}
	if errors.Is(err, sqllock.ErrLeaseLost) {
		// Granted, but over before it could be used: as not acquired.
		return fail(f.conflictCode, "acquire %q: the lease ended before %s could start (%v); not run", f.key, f.commandRaw, err)
	}
	if strings.Contains(err.Error(), fmt.Sprintf("acquire %q", f.key)) {
		return err // the backend named the operation already
	}
	return fmt.Errorf("acquire %q: %w", f.key, err)
}

// tenure is what COMMAND runs under: a Guard's lease (run) or an election
// term (elect).
type tenure struct {
	cmd     string // "run" or "elect", for messages
	key     string
	token   int64
	env     []string        // the SQLLOCK_* variables for COMMAND
	ctx     context.Context // ends at a loss (its cause a *sqllock.LostError) or the release
	release func(context.Context) error
	// deadline is the local deadline now: the supervisor stops COMMAND
	// by it, whatever happens to this process.
	deadline func() time.Time
	// maxAt is the instant of --max-hold, which deadline never passes;
	// zero without one.
	maxAt time.Time
}

// atMaxHold reports whether the local deadline has reached --max-hold:
// renewals no longer move it, and COMMAND is stopped by it.
func (t tenure) atMaxHold() bool {
	return !t.maxAt.IsZero() && !t.deadline().Before(t.maxAt)
}

// guardTenure is run's tenure: the lease of g.
func guardTenure(g *sqllock.Guard, key string) tenure {
	lease := g.Lease()
	return tenure{
		cmd: "run", key: key, token: lease.Token, ctx: g.Context(), release: g.Release, deadline: g.LocalDeadline,
		maxAt: g.MaxHoldDeadline(),
		env: []string{
			"SQLLOCK_KEY=" + key,
			"SQLLOCK_TOKEN=" + strconv.FormatInt(lease.Token, 10),
			"SQLLOCK_OWNER=" + lease.Owner,
		},
	}
}

// releaseTenure releases t once COMMAND has exited (or could not start)
// and returns run's result: retErr, unless a loss detected only by the
// release means that COMMAND's work may have overlapped another holder's.
func (e *env) releaseTenure(t tenure, f runFlags, retErr error, notStarted bool) error {
	name := "sqllock " + t.cmd
	rctx, cancel := context.WithTimeout(context.Background(), releaseTimeout)
	defer cancel()
	rerr := t.release(rctx)
	var s silentExit
	// A stop at --max-hold ended COMMAND while the lease was still held.
	lostBefore := errors.As(retErr, &s) && (int(s) == ExitLeaseLost || int(s) == ExitMaxHold)
	switch {
	case rerr == nil || lostBefore || notStarted:
	case errors.Is(rerr, sqllock.ErrLeaseLost):
		e.errorf("%s: the lease on %q (token %d) had ended before %s exited: %v; its work may have overlapped another holder's",
			name, t.key, t.token, f.commandRaw, rerr)
		return silentExit(ExitLeaseLost)
	default:
		e.errorf("%s: release of %q (token %d) failed: %v; the lease expires by itself within %v", name, t.key, t.token, rerr, f.ttl)
	}
	return retErr
}

func lossReason(l *sqllock.LostError) string {
	switch l.Reason {
	case sqllock.LostReleased:
		return "it was released by someone else (sqllock release --force?)"
	case sqllock.LostTaken:
		s := "another holder took the key"
		if l.Current > 0 {
			s += fmt.Sprintf(" (token %d)", l.Current)
		}
		return s
	case sqllock.LostExpired:
		return "it expired before it could be renewed"
	case sqllock.LostMaxHold:
		return "it reached --max-hold"
	case sqllock.LostUnreachable:
		// What the client knows: no renewal succeeded in time. Why is
		// known only when a renewal failed.
		s := "its local deadline passed without a successful renewal"
		if l.Err != nil {
			s += fmt.Sprintf(" (the last renewal failed: %v)", l.Err)
		} else {
			s += " (no renewal got an answer in time: the database did not reply, or sqllock was paused)"
		}
		return s
	}
	return l.Error()
}

func signalName(s syscall.Signal) string {
	switch s {
	case syscall.SIGTERM:
		return "SIGTERM"
	case syscall.SIGKILL:
		return "SIGKILL"
	case syscall.SIGINT:
		return "SIGINT"
	}
	return s.String()
}
