//go:build unix

package cli

import (
	"bufio"
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"
)

// The supervisor is the process between sqllock and COMMAND: the sqllock
// binary itself, started by run and elect with envSupervisor set. It
// outlives sqllock, so that COMMAND never runs past the lease's local
// deadline whatever happens to sqllock (killed, paused, cut off from the
// database):
//
//   - sqllock tells it every renewed local deadline over a pipe, as the time
//     left when sent (and, on Linux, as an instant of the monotonic clock
//     both processes share, which is not late by the pipe's transit);
//   - at the local deadline, unless a newer one came first, it SIGKILLs
//     COMMAND's process group (and on Linux every other descendant: it is a
//     child subreaper, so no child of COMMAND escapes to init);
//   - once the deadline is nearer than the renewals leave it when they work
//     (a third of the TTL), or sqllock is gone (the pipe's end of file; on Linux
//     also a parent-death signal), it sends SIGTERM first, --grace before the
//     deadline at the latest, so COMMAND can stop gracefully and has stopped
//     before the database can grant the key again;
//   - sqllock forwards signals through it, and asks it to stop COMMAND at
//     once after a loss that is already final (a forced release, a newer
//     token): SIGTERM, SIGKILL after --grace (or at the deadline, if sooner).
//
// When COMMAND has exited and its descendants are gone, the supervisor
// reports COMMAND's status to sqllock and exits.

// envSupervisor, when set, makes sqllock the supervisor; its value is the
// JSON of a supervisorConfig. The supervisor removes it from COMMAND's
// environment.
const envSupervisor = "SQLLOCK_INTERNAL_SUPERVISOR"

// The supervisor's pipes: control from sqllock, report to it.
const (
	supervisorControlFD = 3
	supervisorReportFD  = 4
)

// supervisorConfig is what the supervisor is started with.
type supervisorConfig struct {
	Path string   // COMMAND's resolved path
	Args []string // COMMAND's argv, argv[0] as given
	// Grace is --grace: SIGTERM comes at most this long before SIGKILL.
	Grace time.Duration
	// Overdue: once the local deadline is nearer than this without a
	// renewal, renewals are failing (a third of the TTL: a working renewal
	// comes when two thirds are left, and its first attempt may take half
	// of that).
	Overdue time.Duration
	// Foreground makes COMMAND's group the foreground of the terminal on
	// stdin; JobPgid is sqllock's process group, given the terminal back
	// (and stopped) when COMMAND is stopped from it (Ctrl-Z).
	Foreground bool
	JobPgid    int
	// Parent is sqllock's pid: a parent-death signal is told from a signal
	// someone sent by the parent having changed.
	Parent int
}

// The messages, one per line. Control (sqllock to the supervisor):
//
//	d REMAINING_NS MONO_NS   the local deadline: REMAINING_NS from when it
//	                         was sent; MONO_NS the same instant on the shared
//	                         monotonic clock (0: not known)
//	s SIGNO                  forward signal SIGNO to COMMAND's group
//	stop                     the lease is lost for good: stop COMMAND now
//	cont                     sqllock was continued (after a Ctrl-Z stop)
//
// Report (the supervisor to sqllock):
//
//	started PID
//	notstarted               the local deadline had passed: not started
//	term WHY                 SIGTERM sent (WHY: overdue, gone, stop, left)
//	kill WHY                 SIGKILL sent (WHY: deadline, grace)
//	exit CODE SIGNO          COMMAND's status (SIGNO: the signal that
//	                         killed it, or 0); the last line
//	error TEXT               COMMAND could not be started

// supervisor is the supervising process's state; one goroutine (run) owns
// it, the others only feed its channels.
type supervisor struct {
	cfg    supervisorConfig
	report *os.File
	pid    int // COMMAND's, the leader of its group

	deadline time.Time // the local deadline, on this process's clock
	gone     bool      // sqllock is gone: stop now
	stopAt   time.Time // a final loss was reported at this instant
	termSent bool
	killSent bool
	left     bool // COMMAND exited, leaving processes behind
	exited   bool
	status   syscall.WaitStatus
}

// superviseMain is the supervisor's main; it returns its exit status.
func superviseMain(cfgJSON string) int {
	// The pipes stay with the supervisor: a process of COMMAND's that
	// held the report pipe open would keep sqllock from seeing the
	// supervisor's end, and one that read the control pipe would take its
	// deadlines.
	syscall.CloseOnExec(supervisorControlFD)
	syscall.CloseOnExec(supervisorReportFD)
	s := &supervisor{report: os.NewFile(supervisorReportFD, "report")}
	if err := json.Unmarshal([]byte(cfgJSON), &s.cfg); err != nil {
		fmt.Fprintf(os.Stderr, "sqllock supervisor: bad configuration: %v\n", err)
		return ExitFailure
	}
	becomeSubreaper()
	// Signals first, so that a parent-death signal is not lost.
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGHUP)
	ctl := make(chan []string, 16)
	go readControl(os.NewFile(supervisorControlFD, "control"), ctl)
	first, ok := <-ctl
	if !ok || !s.apply(first) || !time.Now().Before(s.deadline) {
		s.send("notstarted")
		return 0
	}
	if err := s.start(); err != nil {
		s.send("error " + strings.ReplaceAll(err.Error(), "\n", " "))
		return 0
	}
	s.send("started " + strconv.Itoa(s.pid))
	s.run(ctl, sigs)
	code, sig := exitStatusOf(s.status)
	s.send(fmt.Sprintf("exit %d %d", code, sig))
	return 0
}

// start starts COMMAND in a process group of its own.
func (s *supervisor) start() error {
	env := make([]string, 0, len(os.Environ()))
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, envSupervisor+"=") {
			env = append(env, kv)
		}
	}
	pid, err := syscall.ForkExec(s.cfg.Path, s.cfg.Args, &syscall.ProcAttr{
		Env: env, Files: []uintptr{0, 1, 2}, Sys: commandSysProcAttr(s.cfg.Foreground),
	})
	s.pid = pid
	return err
}

// readControl turns the control pipe into messages; its end of file (or an
// error: sqllock is gone either way) closes out.
func readControl(f *os.File, out chan<- []string) {
	defer close(out)
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if fs := strings.Fields(sc.Text()); len(fs) > 0 {
			out <- fs
		}
	}
}

func (s *supervisor) send(line string) { _, _ = s.report.WriteString(line + "\n") }

// apply applies one control message; false for a malformed deadline.
func (s *supervisor) apply(m []string) bool {
	switch m[0] {
	case "d":
		if len(m) != 3 {
			return false
		}
		rem, err1 := strconv.ParseInt(m[1], 10, 64)
		mono, err2 := strconv.ParseInt(m[2], 10, 64)
		if err1 != nil || err2 != nil {
			return false
		}
		s.deadline = receivedDeadline(time.Duration(rem), time.Duration(mono))
		return true
	case "s":
		if len(m) == 2 {
			if n, err := strconv.Atoi(m[1]); err == nil {
				s.signal(syscall.Signal(n))
			}
		}
	case "stop":
		if s.stopAt.IsZero() {
			s.stopAt = time.Now()
		}
	case "cont":
		continueJob(s.cfg, s.pid)
	}
	return true
}

// receivedDeadline is the local deadline sqllock sent, on this process's
// clock: the time left measured from receipt, and no later than the shared
// monotonic clock's instant when there is one.
func receivedDeadline(rem, mono time.Duration) time.Time {
	now := time.Now()
	d := now.Add(rem)
	if mono > 0 {
		if m, ok := monoNow(); ok { // read after now: never late
			if byMono := now.Add(mono - m); byMono.Before(d) {
				d = byMono
			}
		}
	}
	return d
}

// termAt is when SIGTERM is due, killAt when SIGKILL is.
func (s *supervisor) termAt() time.Time {
	t := s.deadline.Add(-min(s.cfg.Grace, s.cfg.Overdue))
	if !s.stopAt.IsZero() && s.stopAt.Before(t) {
		t = s.stopAt
	}
	return t
}

// After a final loss, the local deadline protects nothing any more: the
// key may be granted again at once, and COMMAND gets its --grace.
// Processes that COMMAND left behind get it too, but no later than the
// deadline: the lease is still held.
func (s *supervisor) killAt() time.Time {
	switch {
	case s.stopAt.IsZero():
		return s.deadline
	case !s.left || s.stopAt.Add(s.cfg.Grace).Before(s.deadline):
		return s.stopAt.Add(s.cfg.Grace)
	}
	return s.deadline
}

// run supervises COMMAND until it has exited and no descendant is left.
func (s *supervisor) run(ctl <-chan []string, sigs <-chan os.Signal) {
	exits, stops, empty := make(chan syscall.WaitStatus, 1), make(chan struct{}, 1), make(chan struct{})
	go reap(s.pid, exits, stops, empty)
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	for {
		if s.exited {
			if !s.alive(empty) {
				return
			}
			if s.stopAt.IsZero() {
				// COMMAND exited and left processes behind: they get
				// the same grace, never past the deadline.
				s.stopAt, s.left = time.Now(), true
			}
		}
		s.act(time.Now())
		timer.Reset(s.nextWake())
		select {
		case m, ok := <-ctl:
			if !ok {
				ctl, s.gone = nil, true
				continue
			}
			s.apply(m)
		case sig := <-sigs:
			if os.Getppid() != s.cfg.Parent {
				s.gone = true // the parent-death signal
			} else {
				s.signal(sig.(syscall.Signal))
			}
		case ws := <-exits:
			s.exited, s.status = true, ws
		case <-stops:
			stopJob(s.cfg)
		case <-empty:
		case <-timer.C:
		case <-tick.C: // while draining the group after COMMAND exited
		}
	}
}

// act sends the signals that are due at now.
func (s *supervisor) act(now time.Time) {
	if !s.termSent {
		why := ""
		switch {
		case s.gone:
			why = "gone"
		case s.left:
			why = "left"
		case !s.stopAt.IsZero():
			why = "stop"
		case !now.Before(s.termAt()):
			why = "overdue"
		}
		if why != "" {
			s.termSent = true
			s.signal(syscall.SIGTERM)
			s.send("term " + why)
		}
	}
	if !s.killSent && !now.Before(s.killAt()) {
		s.killSent = true
		why := "deadline"
		if !s.stopAt.IsZero() && s.killAt().Equal(s.stopAt.Add(s.cfg.Grace)) {
			why = "grace"
		}
		s.send("kill " + why)
	}
	if s.killSent {
		s.signal(syscall.SIGKILL) // again each round: what was forked meanwhile
	}
}

func (s *supervisor) nextWake() time.Duration {
	next := s.killAt()
	if !s.termSent && s.termAt().Before(next) {
		next = s.termAt()
	}
	return max(time.Until(next), time.Millisecond)
}

// signal sends sig to COMMAND's group and the supervisor's other children
// (descendants that left the group and were orphaned to it). A stopped
// process acts on SIGTERM or SIGINT only once continued, so SIGCONT follows
// them, as a shell's kill does for a job.
func (s *supervisor) signal(sig syscall.Signal) {
	targets := append([]int{-s.pid}, children()...)
	for _, p := range targets {
		if p == s.pid && s.exited {
			continue
		}
		_ = syscall.Kill(p, sig)
		if sig == syscall.SIGTERM || sig == syscall.SIGINT {
			_ = syscall.Kill(p, syscall.SIGCONT)
		}
	}
}

// alive reports whether anything of COMMAND is left: its group, or (where
// the supervisor is a subreaper) any descendant.
func (s *supervisor) alive(empty <-chan struct{}) bool {
	select {
	case <-empty:
		return false
	default:
	}
	if syscall.Kill(-s.pid, 0) == nil {
		return true
	}
	return subreaper && len(children()) > 0
}

// reap waits for the supervisor's children: COMMAND's exit goes to exits,
// its stops (Ctrl-Z) to stops; every other child (orphans reparented to
// the subreaper) is reaped. empty is closed when no child is left.
func reap(pid int, exits chan<- syscall.WaitStatus, stops chan<- struct{}, empty chan<- struct{}) {
	defer close(empty)
	for {
		var ws syscall.WaitStatus
		p, err := syscall.Wait4(-1, &ws, syscall.WUNTRACED, nil)
		switch {
		case err == syscall.EINTR:
		case err != nil:
			return // ECHILD: no child left
		case p == pid && ws.Stopped():
			select {
			case stops <- struct{}{}:
			default:
			}
		case p == pid && (ws.Exited() || ws.Signaled()):
			exits <- ws
		}
	}
}

// exitStatusOf is COMMAND's exit status (128+N for a death by signal N)
// and the signal.
func exitStatusOf(ws syscall.WaitStatus) (int, int) {
	if ws.Signaled() {
		return exitSignalBase + int(ws.Signal()), int(ws.Signal())
	}
	return ws.ExitStatus(), 0
}

// stopJob passes a Ctrl-Z stop of COMMAND on to sqllock's job: the
// terminal stopped COMMAND's group only (its foreground), which would leave
// the shell waiting for a sqllock that still runs. So the terminal goes
// back to sqllock's group, which is stopped: the shell regains control.
// When the shell continues sqllock, sqllock says so (cont) and
// continueJob hands the terminal back (after fg) and continues COMMAND.
// Meanwhile the lease is not renewed, and the deadline is kept as always.
func stopJob(cfg supervisorConfig) {
	if !cfg.Foreground {
		return
	}
	setForeground(cfg.JobPgid)
	_ = syscall.Kill(-cfg.JobPgid, syscall.SIGTSTP)
}

func continueJob(cfg supervisorConfig, pid int) {
	if !cfg.Foreground {
		return
	}
	if fg, err := tcgetpgrp(0); err == nil && fg == cfg.JobPgid {
		setForeground(pid)
	}
	_ = syscall.Kill(-pid, syscall.SIGCONT)
}

// setForeground makes pgid the foreground of the terminal on stdin. From a
// background group tcsetpgrp raises SIGTTOU, which is ignored for the call
// (and only then: an ignored signal would stay ignored in what is started).
func setForeground(pgid int) {
	signal.Ignore(syscall.SIGTTOU)
	defer signal.Reset(syscall.SIGTTOU)
	p := int32(pgid)
	_, _, _ = syscall.Syscall(syscall.SYS_IOCTL, 0, uintptr(syscall.TIOCSPGRP), uintptr(unsafe.Pointer(&p)))
}
