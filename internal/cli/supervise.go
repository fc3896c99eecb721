//go:build unix

package cli

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// feedInterval is how often sqllock looks for a renewed local deadline to
// pass on to the supervisor. A renewal comes when two thirds of the TTL
// (at least 1s) are left, so a new deadline reaches the supervisor long
// before the one it replaces.
const feedInterval = 20 * time.Millisecond

// supervised is a running supervisor, as sqllock sees it. Only the
// goroutine of supervise uses it; reports is fed by a reader goroutine.
type supervised struct {
	cmd     *exec.Cmd
	ctl     *os.File      // the control pipe's write end
	reports chan []string // the report pipe's lines; closed at its end
	sent    time.Time     // the last local deadline sent
	tty     int           // the terminal COMMAND's group got, or -1
	pid     int           // COMMAND's, which is also its process group's
	// What the supervisor reported.
	started, notStarted, exited bool
	startErr                    string
	term, kill                  string // why SIGTERM, SIGKILL were sent ("": not sent)
	code, sig                   int
}

// startSupervisor starts the supervisor, which starts COMMAND under t.
func (e *env) startSupervisor(t tenure, f runFlags) (*supervised, error) {
	exe, err := supervisorExe()
	if err != nil {
		return nil, fail(ExitCannotExec, "start the supervisor of %s: %v", f.commandRaw, err)
	}
	s := &supervised{tty: foregroundTTY(e.stdin), reports: make(chan []string, 16)}
	cfg, _ := json.Marshal(supervisorConfig{
		Path: f.command[0], Args: append([]string{f.commandRaw}, f.command[1:]...),
		Grace: f.grace, Overdue: f.ttl / 3, // termLead(f) is the lesser of the two
		Foreground: s.tty >= 0, JobPgid: syscall.Getpgrp(), Parent: os.Getpid(),
	})
	ctlR, ctlW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	repR, repW, err := os.Pipe()
	if err != nil {
		ctlR.Close()
		ctlW.Close()
		return nil, err
	}
	cmd := exec.Command(exe)
	cmd.Args[0] = "sqllock" // its main in tests too
	cmd.Stdin, cmd.Stdout, cmd.Stderr = e.stdin, e.stdout, e.stderr
	cmd.Env = append(append(e.environ(), t.env...), envSupervisor+"="+string(cfg))
	cmd.ExtraFiles = []*os.File{ctlR, repW} // fds 3 and 4
	cmd.SysProcAttr = supervisorSysProcAttr()
	// Bounds the copying of non-file stdio after COMMAND exits (a child
	// that keeps a pipe open); os.File stdio is passed directly.
	cmd.WaitDelay = f.grace + time.Second
	err = cmd.Start()
	ctlR.Close()
	repW.Close()
	if err != nil {
		ctlW.Close()
		repR.Close()
		return nil, fail(ExitCannotExec, "start the supervisor of %s: %v", f.commandRaw, err)
	}
	s.cmd, s.ctl = cmd, ctlW
	// sqllock is a child subreaper too (on Linux): should the supervisor
	// be killed, what COMMAND started is orphaned to sqllock, which
	// stops it (stopRemains) before it gives the lease up.
	becomeSubreaper()
	go func() {
		defer close(s.reports)
		defer repR.Close()
		sc := bufio.NewScanner(repR)
		for sc.Scan() {
			if fs := strings.Fields(sc.Text()); len(fs) > 0 {
				s.reports <- fs
			}
		}
	}()
	s.feed(t.deadline())
	return s, nil
}

// superviseMargin is the Client's safety margin for a lease that a
// command runs under (run, elect): TTL/20, at most a second, and never
// less than the library's default (TTL/100 + 2ms). The supervisor that
// SIGKILLs the command at the local deadline is a process the OS
// schedules on its own: on a loaded host its kill lands late (up to about
// 40 ms seen at load 16 on 2 cores), which is a pause of the holder, and
// the library's margin (22 ms at a 2 s TTL) does not cover that. The cost
// is the command stopped that much earlier in an outage.
func superviseMargin(ttl time.Duration) time.Duration {
	return max(min(ttl/20, time.Second), min(ttl/100+2*time.Millisecond, ttl/4))
}

// termLead is how long before the local deadline the supervisor sends
// SIGTERM once renewals no longer move it (its termAt): --grace, at most
// the Overdue it is started with.
func termLead(f runFlags) time.Duration { return min(f.grace, f.ttl/3) }

// feed sends the local deadline d if it is new: the time left, and on
// Linux the same instant on the monotonic clock the supervisor shares. The
// clock is read before the time left, so that neither can come out later
// than d, however long this process is paused in between.
func (s *supervised) feed(d time.Time) {
	if d.Equal(s.sent) {
		return
	}
	s.sent = d
	m, ok := monoNow()
	rem := time.Until(d)
	mono := time.Duration(0)
	if ok {
		mono = max(m+rem, 1)
	}
	s.send(fmt.Sprintf("d %d %d", int64(rem), int64(mono)))
}

func (s *supervised) send(line string) { _, _ = s.ctl.WriteString(line + "\n") }

// handle records one report; it returns the SIGTERM reason when one was
// sent, for a message.
func (s *supervised) handle(r []string) string {
	arg := ""
	if len(r) > 1 {
		arg = r[1]
	}
	switch r[0] {
	case "started":
		s.started = true
		s.pid, _ = strconv.Atoi(arg)
	case "notstarted":
		s.notStarted = true
	case "error":
		s.startErr = strings.Join(r[1:], " ")
	case "term":
		s.term = arg
		return arg
	case "kill":
		s.kill = arg
	case "exit":
		if len(r) == 3 {
			s.code, _ = strconv.Atoi(r[1])
			s.sig, _ = strconv.Atoi(r[2])
			s.exited = true
		}
	}
	return ""
}

// supervise runs COMMAND under t and returns its exit status as a
// silentExit (or an error to print): COMMAND's own, or ExitLeaseLost when
// t was lost while it ran, or it had to be stopped because t could not be
// renewed in time, or ExitTempFail when t was lost before it started.
// run and elect both run their command through it; each supplies only its
// tenure.
func (e *env) supervise(t tenure, f runFlags, sigs <-chan os.Signal) (retErr error) {
	name := "sqllock " + t.cmd
	notStarted := false // lost before COMMAND started: already reported
	defer func() { retErr = e.releaseTenure(t, f, retErr, notStarted) }()
	var lost *sqllock.LostError
	if beforeStart != nil {
		beforeStart()
	}
	// Never start COMMAND without the lock: a lease lost since the
	// acquire (renewals failed, or a forced release) means not run.
	if errors.As(context.Cause(t.ctx), &lost) {
		e.errorf("%s: lost the lease on %q (token %d) before %s started: %s; not run",
			name, t.key, t.token, f.commandRaw, lossReason(lost))
		notStarted = true
		return silentExit(f.conflictCode)
	}
	s, err := e.startSupervisor(t, f)
	if err != nil {
		return err
	}
	lost = e.feedSupervisor(s, t, f, sigs)
	waitErr := s.cmd.Wait()
	s.ctl.Close()
	if s.tty >= 0 {
		restoreTerminal(s.tty)
	}
	switch {
	case s.notStarted:
		e.errorf("%s: the lease on %q (token %d) had reached its local deadline before %s started; not run",
			name, t.key, t.token, f.commandRaw)
		notStarted = true
		return silentExit(f.conflictCode)
	case s.startErr != "":
		return fail(ExitCannotExec, "start %s: %s", f.commandRaw, s.startErr)
	case !s.exited:
		// The supervisor was killed. COMMAND got its parent-death
		// signal (Linux); what it started did not: stop it before the
		// lease is given up, or the next holder would run beside it.
		if !stopRemains(s.pid, t.deadline()) {
			e.errorf("%s: the process supervising %s ended without its status (%v); processes of %s were still running at the lease's local deadline",
				name, f.commandRaw, waitErr, f.commandRaw)
			return silentExit(ExitFailure)
		}
		e.errorf("%s: the process supervising %s ended without its status (%v); %s was killed with it",
			name, f.commandRaw, waitErr, f.commandRaw)
		return silentExit(ExitFailure)
	}
	return e.commandOutcome(s, t, f, lost)
}

// stopRemains SIGKILLs what is left of COMMAND once its supervisor has
// ended without reporting COMMAND's exit: COMMAND's process group (pgid;
// 0: COMMAND never started) and, on Linux, where sqllock is a child
// subreaper, every descendant orphaned to sqllock (a process COMMAND
// started in a session of its own included), reaping them, until none is
// left or until passes. It reports whether none is left. sqllock's only
// other child, the supervisor, has been waited for.
func stopRemains(pgid int, until time.Time) bool {
	for {
		left := false
		if pgid > 0 && syscall.Kill(-pgid, syscall.SIGKILL) == nil {
			left = true
		}
		for _, p := range children() {
			left = true
			_ = syscall.Kill(p, syscall.SIGKILL)
			var ws syscall.WaitStatus
			_, _ = syscall.Wait4(p, &ws, syscall.WNOHANG, nil)
		}
		if !left {
			return true
		}
		if !time.Now().Before(until) {
			return false
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// feedSupervisor feeds the supervisor until it has exited: renewed local
// deadlines, forwarded signals, a final loss, and sqllock's continuation
// after a Ctrl-Z stop. It returns the loss seen while COMMAND ran, if any.
func (e *env) feedSupervisor(s *supervised, t tenure, f runFlags, sigs <-chan os.Signal) *sqllock.LostError {
	name := "sqllock " + t.cmd
	var lost *sqllock.LostError
	tick := time.NewTicker(feedInterval)
	defer tick.Stop()
	cont := make(chan os.Signal, 1)
	if s.tty >= 0 {
		signal.Notify(cont, syscall.SIGCONT)
		defer signal.Stop(cont)
	}
	leaseEnd := t.ctx.Done()
	for {
		select {
		case r, ok := <-s.reports:
			if !ok {
				return lost
			}
			if why := s.handle(r); why == "overdue" || why == "left" {
				e.reportTerm(s, t, f, why)
			}
		case sig := <-sigs:
			if n, ok := sig.(syscall.Signal); ok {
				s.send("s " + strconv.Itoa(int(n)))
			}
		case <-tick.C:
			s.feed(t.deadline())
		case <-cont:
			s.send("cont")
		case <-leaseEnd:
			leaseEnd = nil
			if !errors.As(context.Cause(t.ctx), &lost) {
				continue // released: only after COMMAND exited
			}
			if lost.Reason == sqllock.LostMaxHold {
				// The supervisor stops COMMAND by the deadline, which is
				// the max hold, on its own: a "stop" would give it
				// --grace past it, while the lease may end sooner.
				continue
			}
			if s.term != "" {
				e.errorf("%s: lost the lease on %q (token %d): %s", name, t.key, t.token, lossReason(lost))
				continue
			}
			e.errorf("%s: lost the lease on %q (token %d): %s; stopping %s: SIGTERM now, SIGKILL in %v if it still runs",
				name, t.key, t.token, lossReason(lost), f.commandRaw, f.grace)
			s.send("stop")
		}
	}
}

// reportTerm says why the supervisor sent SIGTERM on its own.
func (e *env) reportTerm(s *supervised, t tenure, f runFlags, why string) {
	name := "sqllock " + t.cmd
	left := max(time.Until(t.deadline()), 0).Round(time.Millisecond)
	if why == "left" {
		e.errorf("%s: %s exited and left processes running; stopping them: SIGTERM now, SIGKILL in %v if they still run",
			name, f.commandRaw, min(f.grace, left))
		return
	}
	if t.atMaxHold() {
		e.errorf("%s: %s reached --max-hold %v on %q (token %d); stopping it: SIGTERM now, SIGKILL in %v if it still runs",
			name, f.commandRaw, f.maxHold, t.key, t.token, left)
		return
	}
	e.errorf("%s: the lease on %q (token %d) was not renewed in time (%v left); stopping %s before it ends: SIGTERM now, SIGKILL at its local deadline if it still runs",
		name, t.key, t.token, left, f.commandRaw)
}

// commandOutcome is run's exit status once COMMAND has exited, as the
// supervisor reported it.
func (e *env) commandOutcome(s *supervised, t tenure, f runFlags, lost *sqllock.LostError) error {
	name := "sqllock " + t.cmd
	if lost == nil && s.term == "overdue" {
		if lost = t.overdueLoss(); lost != nil {
			e.errorf("%s: lost the lease on %q (token %d): %s", name, t.key, t.token, lossReason(lost))
		}
	}
	if e.log != nil {
		e.log.Info(name+": command exited", "key", t.key, "token", t.token, "command", f.commandRaw, "status", s.code)
	}
	stopped := lost != nil || s.term == "overdue"
	maxHold := (lost != nil && lost.Reason == sqllock.LostMaxHold) || (lost == nil && t.atMaxHold())
	if !stopped {
		if errors.As(context.Cause(t.ctx), &lost) && lost.Reason == sqllock.LostMaxHold {
			// Ended at the max hold as COMMAND exited: the lease was
			// held until then, so no other holder overlapped it.
			e.errorf("%s: %s reached --max-hold on %q (token %d) as it exited; exit status %d", name, f.commandRaw, t.key, t.token, ExitMaxHold)
			return silentExit(ExitMaxHold)
		}
		if lost != nil {
			// Lost at the moment COMMAND exited: its work may have
			// overlapped another holder's all the same.
			e.errorf("%s: lost the lease on %q (token %d) as %s exited: %s", name, t.key, t.token, f.commandRaw, lossReason(lost))
			return silentExit(ExitLeaseLost)
		}
		return silentExit(s.code)
	}
	how := fmt.Sprintf("it exited with status %d", s.code)
	if s.sig != 0 {
		how = "it died by " + signalName(syscall.Signal(s.sig))
	}
	switch s.kill {
	case "grace":
		how += fmt.Sprintf("; SIGKILL sent after the %v grace", f.grace)
	case "deadline":
		how += "; SIGKILL sent at the lease's local deadline"
	}
	if maxHold && s.term != "stop" {
		e.errorf("%s: %s was stopped because it reached --max-hold %v on %q (%s); exit status %d",
			name, f.commandRaw, f.maxHold, t.key, how, ExitMaxHold)
		return silentExit(ExitMaxHold)
	}
	why := "was lost"
	if lost == nil {
		why = "could not be renewed in time"
	}
	e.errorf("%s: %s was stopped because the lease on %q %s (%s)%s",
		name, f.commandRaw, t.key, why, how, t.afterLoss())
	return silentExit(ExitLeaseLost)
}
