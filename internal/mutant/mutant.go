// Package mutant holds deliberately broken behaviours of the client and the
// memory backend. The robustness suite switches one on to prove that its
// checkers catch it: a checker that cannot fail proves nothing. Production
// code never sets a mutant; when none is set, each hook costs one atomic
// load.
package mutant

import "sync/atomic"

// Kind names one broken behaviour.
type Kind int32

// The mutants.
const (
	None Kind = iota
	// DeadlineFromReply computes the guard's local deadline from the time
	// the reply arrived instead of the time the request was sent.
	DeadlineFromReply
	// RenewIgnoresToken makes the memory backend renew any held, unexpired
	// lease of the key, whatever its token.
	RenewIgnoresToken
	// ReleaseDeletesRow makes the memory backend delete the key on release,
	// so its token restarts at 1.
	ReleaseDeletesRow
	// GuardIgnoresLoss keeps a guard alive when a renewal reports the lease
	// lost (it is still cancelled at its local deadline).
	GuardIgnoresLoss
)

var active atomic.Int32

// Set switches k on (None switches every mutant off) and returns a function
// that restores the previous setting. Tests that call it must not run in
// parallel with tests that expect correct behaviour.
func Set(k Kind) (restore func()) {
	prev := active.Swap(int32(k))
	return func() { active.Store(prev) }
}

// On reports whether k is switched on.
func On(k Kind) bool { return k != None && Kind(active.Load()) == k }

func (k Kind) String() string {
	switch k {
	case None:
		return "none"
	case DeadlineFromReply:
		return "deadline-from-reply"
	case RenewIgnoresToken:
		return "renew-ignores-token"
	case ReleaseDeletesRow:
		return "release-deletes-row"
	case GuardIgnoresLoss:
		return "guard-ignores-loss"
	}
	return "unknown"
}

// deterministicOwners is not a broken behaviour but a replay switch; see
// SetDeterministicOwners.
var deterministicOwners atomic.Bool

// SetDeterministicOwners makes every sqllock.Client derive the random part
// of its lease owners from its owner name instead of drawing it, so that a
// simulation replays byte for byte. It is safe only while every Client has
// an owner name of its own (as in the simulation); production never sets
// it. It returns a function that restores the previous setting.
func SetDeterministicOwners(on bool) (restore func()) {
	prev := deterministicOwners.Swap(on)
	return func() { deterministicOwners.Store(prev) }
}

// DeterministicOwners reports whether SetDeterministicOwners is on.
func DeterministicOwners() bool { return deterministicOwners.Load() }
