//go:build unix

package cli

import (
	"io"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
	"unsafe"
)

// processGroup is COMMAND's own process group: signals sent to it reach
// every process COMMAND started (that did not leave the group).
type processGroup struct {
	pgid int
	// tty is the terminal COMMAND's group was made the foreground of; -1
	// when none.
	tty int
}

// prepareGroup makes cmd start in a process group of its own. When stdin
// is the terminal this process is the foreground of, COMMAND's group becomes
// the terminal's foreground instead (as a shell does for a job), so that an
// interactive COMMAND can read the terminal and Ctrl-C reaches it directly.
func prepareGroup(cmd *exec.Cmd, stdin io.Reader) *processGroup {
	pg := &processGroup{tty: -1}
	attr := &syscall.SysProcAttr{Setpgid: true}
	if f, ok := stdin.(*os.File); ok {
		fd := int(f.Fd())
		if fg, err := tcgetpgrp(fd); err == nil && fg == syscall.Getpgrp() {
			// With Foreground, Ctty is a descriptor of this process.
			attr.Foreground, attr.Ctty = true, fd
			pg.tty = fd
		}
	}
	cmd.SysProcAttr = attr
	return pg
}

// started records the group of the started COMMAND.
func (pg *processGroup) started(p *os.Process) { pg.pgid = p.Pid }

// signal sends sig to the whole group; an error once every member is gone.
// A stopped process acts on SIGTERM or SIGINT only once continued, so
// SIGCONT follows them, as a shell's kill does for a job.
func (pg *processGroup) signal(sig syscall.Signal) error {
	err := syscall.Kill(-pg.pgid, sig)
	if err == nil && (sig == syscall.SIGTERM || sig == syscall.SIGINT) {
		_ = syscall.Kill(-pg.pgid, syscall.SIGCONT)
	}
	return err
}

// alive reports whether any process of the group is left.
func (pg *processGroup) alive() bool { return pg.signal(0) == nil }

// restoreTerminal gives the terminal's foreground back to this process's
// group after COMMAND exited. tcsetpgrp from a background group raises
// SIGTTOU, which is ignored for the call.
func (pg *processGroup) restoreTerminal() {
	if pg.tty < 0 {
		return
	}
	signal.Ignore(syscall.SIGTTOU)
	defer signal.Reset(syscall.SIGTTOU)
	pgrp := int32(syscall.Getpgrp())
	_, _, _ = syscall.Syscall(syscall.SYS_IOCTL, uintptr(pg.tty), uintptr(syscall.TIOCSPGRP), uintptr(unsafe.Pointer(&pgrp)))
}

func tcgetpgrp(fd int) (int, error) {
	var pgrp int32
	if _, _, errno := syscall.Syscall(syscall.SYS_IOCTL, uintptr(fd), uintptr(syscall.TIOCGPGRP), uintptr(unsafe.Pointer(&pgrp))); errno != 0 {
		return 0, errno
	}
	return int(pgrp), nil
}

// waitSignaled reports the signal that killed the process, if one did.
func waitSignaled(ps *os.ProcessState) (syscall.Signal, bool) {
	if ws, ok := ps.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		return ws.Signal(), true
	}
	return 0, false
}
