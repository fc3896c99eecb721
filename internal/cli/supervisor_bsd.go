//go:build unix && !linux

package cli

import (
	"os"
	"syscall"
	"time"
)

// Without Linux's child subreaper and parent-death signals, the supervisor
// stops COMMAND's group when sqllock is gone (the control pipe's end of
// file) or at the deadline; a descendant that left the group, or a
// SIGKILL of the supervisor itself, escapes it.
const subreaper = false

func becomeSubreaper() {}

func commandSysProcAttr(foreground bool) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Foreground: foreground, Ctty: 0}
}

func supervisorSysProcAttr() *syscall.SysProcAttr { return &syscall.SysProcAttr{Setpgid: true} }

func children() []int { return nil }

func supervisorExe() (string, error) { return os.Executable() }

// monoNow: no clock shared with sqllock; the time left is measured from
// the message's receipt.
func monoNow() (time.Duration, bool) { return 0, false }
