package cli

import (
	"os"
	"os/signal"
	"syscall"
	"unsafe"
)

// proxyStops makes Ctrl-Z work while COMMAND owns the terminal. The
// terminal stops COMMAND's group only (the foreground), which would leave
// the shell waiting for a sqllock that still runs. So when COMMAND stops,
// sqllock takes the terminal back and stops itself, which returns control
// to the shell; when the shell continues sqllock (fg or bg), sqllock hands
// the terminal back (after fg) and continues COMMAND. The lease is not
// renewed while sqllock is stopped: a long stop loses it, and COMMAND is
// then stopped as after any loss. It returns a function that ends the proxy.
func (pg *processGroup) proxyStops() func() {
	if pg.tty < 0 {
		return func() {}
	}
	chld := make(chan os.Signal, 1)
	cont := make(chan os.Signal, 1)
	done := make(chan struct{})
	finished := make(chan struct{})
	signal.Notify(chld, syscall.SIGCHLD)
	signal.Notify(cont, syscall.SIGCONT)
	go func() {
		defer close(finished)
		for {
			select {
			case <-done:
				return
			case <-chld:
			}
			if !childStopped(pg.pgid) {
				continue
			}
			pg.restoreTerminal()
			// Drop a stale continuation, then stop this process's group
			// (sqllock's job) and wait to be continued.
			select {
			case <-cont:
			default:
			}
			_ = syscall.Kill(0, syscall.SIGTSTP)
			select {
			case <-done:
				return
			case <-cont:
			}
			if fg, err := tcgetpgrp(pg.tty); err == nil && fg == syscall.Getpgrp() {
				pgid := int32(pg.pgid)
				_, _, _ = syscall.Syscall(syscall.SYS_IOCTL, uintptr(pg.tty), uintptr(syscall.TIOCSPGRP), uintptr(unsafe.Pointer(&pgid)))
			}
			_ = syscall.Kill(-pg.pgid, syscall.SIGCONT)
		}
	}()
	return func() {
		signal.Stop(chld)
		signal.Stop(cont)
		close(done)
		<-finished
	}
}

// childStopped reports (and consumes) a stop of process pid, without
// touching its exit status, which exec.Cmd.Wait collects.
func childStopped(pid int) bool {
	const (
		pPID       = 1
		wNOHANG    = 0x1
		wSTOPPED   = 0x2
		cldStopped = 5
	)
	var info struct {
		signo, errno, code int32
		_                  int32
		pid                int32
		uid                uint32
		status             int32
		_                  [128 - 28]byte
	}
	_, _, errno := syscall.Syscall6(syscall.SYS_WAITID, pPID, uintptr(pid), uintptr(unsafe.Pointer(&info)), wNOHANG|wSTOPPED, 0, 0)
	return errno == 0 && info.pid == int32(pid) && info.code == cldStopped
}
