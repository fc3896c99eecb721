//go:build !linux

package pgserver

import "syscall"

// dieWithParent does nothing where the system has no parent-death signal.
func dieWithParent(*syscall.SysProcAttr) {}
