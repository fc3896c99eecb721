package cli

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
	"unsafe"
)

// subreaper: on Linux the supervisor is a child subreaper, so every
// descendant of COMMAND that is orphaned becomes its child, and none
// escapes the kill at the deadline.
const subreaper = true

const prSetChildSubreaper = 36 // PR_SET_CHILD_SUBREAPER, linux/prctl.h

func becomeSubreaper() {
	_, _, _ = syscall.RawSyscall(syscall.SYS_PRCTL, prSetChildSubreaper, 1, 0)
}

// commandSysProcAttr starts COMMAND in a process group of its own (the
// terminal's foreground if asked), killed if the supervisor dies.
func commandSysProcAttr(foreground bool) *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Foreground: foreground, Ctty: 0, Pdeathsig: syscall.SIGKILL}
}

// supervisorSysProcAttr starts the supervisor in a process group of its
// own (a stop of sqllock's job leaves it running), with a parent-death
// signal: the second line after the control pipe's end of file.
func supervisorSysProcAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGTERM}
}

// children are the supervisor's live child processes, from every thread's
// /proc children list; nil where the kernel does not provide them.
func children() []int {
	tasks, _ := filepath.Glob("/proc/self/task/*/children")
	var out []int
	for _, t := range tasks {
		data, err := os.ReadFile(t)
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(data)) {
			if pid, err := strconv.Atoi(f); err == nil {
				out = append(out, pid)
			}
		}
	}
	return out
}

// supervisorExe is the sqllock binary to start as the supervisor: this
// process's own image, even if the file was replaced since it started.
func supervisorExe() (string, error) { return "/proc/self/exe", nil }

// monoNow reads CLOCK_MONOTONIC, the clock Go's monotonic readings come
// from, which every process of the host shares.
func monoNow() (time.Duration, bool) {
	var ts syscall.Timespec
	if _, _, errno := syscall.Syscall(syscall.SYS_CLOCK_GETTIME, 1, uintptr(unsafe.Pointer(&ts)), 0); errno != 0 {
		return 0, false
	}
	return time.Duration(ts.Nano()), true
}
