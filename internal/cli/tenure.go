package cli

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// afterLoss ends the message that says COMMAND was stopped after a loss
// with what sqllock does next: run exits 76; elect campaigns again (its
// loop says so), so no exit status is named.
func (t tenure) afterLoss() string {
	if t.cmd == "elect" {
		return ""
	}
	return fmt.Sprintf("; exit status %d", ExitLeaseLost)
}

// checkConflictCode checks --conflict-exit-code: an exit status.
func checkConflictCode(code int) error {
	if code < 0 || code > 255 {
		return fail(ExitUsage, "--conflict-exit-code %d: must be from 0 to 255", code)
	}
	return nil
}

// overdueLoss is t's loss once its local deadline has passed, for a
// COMMAND the supervisor stopped because t could not be renewed in time:
// past that deadline the Guard ends at once, but a sqllock that was paused
// (SIGSTOP) may read the supervisor's report before its own timers have
// run. It waits that instant, at most a second, so that the message says
// why; before the deadline (COMMAND stopped early, at SIGTERM) it waits
// for nothing.
func (t tenure) overdueLoss() *sqllock.LostError {
	if time.Until(t.deadline()) > 0 {
		return nil
	}
	wait := time.NewTimer(time.Second)
	defer wait.Stop()
	select {
	case <-t.ctx.Done():
	case <-wait.C:
	}
	var lost *sqllock.LostError
	if errors.As(context.Cause(t.ctx), &lost) {
		return lost
	}
	return nil
}
