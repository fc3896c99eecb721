package pgserver

import "syscall"

// dieWithParent makes the child get SIGKILL when this process dies, so a
// test binary that panics or times out leaves no PgBouncer behind.
func dieWithParent(a *syscall.SysProcAttr) { a.Pdeathsig = syscall.SIGKILL }
