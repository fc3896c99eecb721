package cli

import "fmt"

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
