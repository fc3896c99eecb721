//go:build !unix

package cli

import (
	"context"
	"os"
)

// envSupervisor: see supervisor.go; there is no supervisor without Unix
// process groups and signals.
const envSupervisor = "SQLLOCK_INTERNAL_SUPERVISOR"

func superviseMain(string) int { return ExitFailure }

// supervise refuses: without a supervisor, COMMAND could outlive its lease.
func (e *env) supervise(t tenure, f runFlags, _ <-chan os.Signal) error {
	_ = t.release(context.Background())
	return fail(ExitCannotExec, "sqllock %s: running a command under a lease needs a Unix system (a supervisor that can stop its process group)", t.cmd)
}
