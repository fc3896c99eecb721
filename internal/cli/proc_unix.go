//go:build unix

package cli

import (
	"io"
	"os"
	"os/signal"
	"syscall"
	"unsafe"
)

// foregroundTTY is the descriptor of stdin when it is the terminal this
// process is the foreground of, else -1. COMMAND's group is then made the
// terminal's foreground instead (as a shell does for a job), so that an
// interactive COMMAND can read the terminal and Ctrl-C reaches it directly.
func foregroundTTY(stdin io.Reader) int {
	if f, ok := stdin.(*os.File); ok {
		fd := int(f.Fd())
		if fg, err := tcgetpgrp(fd); err == nil && fg == syscall.Getpgrp() {
			return fd
		}
	}
	return -1
}

// restoreTerminal gives the terminal's foreground back to this process's
// group after COMMAND exited. tcsetpgrp from a background group raises
// SIGTTOU, which is ignored for the call.
func restoreTerminal(tty int) {
	signal.Ignore(syscall.SIGTTOU)
	defer signal.Reset(syscall.SIGTTOU)
	pgrp := int32(syscall.Getpgrp())
	_, _, _ = syscall.Syscall(syscall.SYS_IOCTL, uintptr(tty), uintptr(syscall.TIOCSPGRP), uintptr(unsafe.Pointer(&pgrp)))
}

func tcgetpgrp(fd int) (int, error) {
	var pgrp int32
	if _, _, errno := syscall.Syscall(syscall.SYS_IOCTL, uintptr(fd), uintptr(syscall.TIOCGPGRP), uintptr(unsafe.Pointer(&pgrp))); errno != 0 {
		return 0, errno
	}
	return int(pgrp), nil
}
