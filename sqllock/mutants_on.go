//go:build sqllock_mutants

package sqllock

import "sync/atomic"

// This file exists only in builds with the sqllock_mutants tag: the
// simulation's checker-sensitivity test switches one of the client's
// deliberately broken behaviours on to prove that its checkers catch it.
// No user build contains it (see mutants_off.go).

var activeMutant atomic.Int32

var mutantNames = map[mutant]string{
	mutantDeadlineFromReply:      "deadline-from-reply",
	mutantGuardIgnoresLoss:       "guard-ignores-loss",
	mutantBatchDeadlineFromReply: "batch-deadline-from-reply",
	mutantRenewUnbounded:         "renew-unbounded",
}

func mutantOn(m mutant) bool { return mutant(activeMutant.Load()) == m }

// SetMutant switches the client's broken behaviour named name on ("" turns
// every one off) and returns a function that restores the previous setting,
// and false for a name that is not a client mutant. Tests that call it must
// not run in parallel with tests that expect correct behaviour.
func SetMutant(name string) (restore func(), ok bool) {
	var m mutant // none
	for k, n := range mutantNames {
		if n == name {
			m = k
		}
	}
	if m == 0 && name != "" {
		return func() {}, false
	}
	prev := activeMutant.Swap(int32(m))
	return func() { activeMutant.Store(prev) }, true
}
