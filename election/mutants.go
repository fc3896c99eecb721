package election

// mutant names a deliberately broken behaviour of the election (see
// mutants_off.go and mutants_on.go).
type mutant int32

const (
	// mutantLeadPastDeadline derives the leader's function context from
	// Run's context instead of the leadership's: it does not end at the
	// guard's loss or local deadline.
	mutantLeadPastDeadline mutant = iota + 1
	// mutantRunReturnsOnLoss makes Run return after a lost term instead of
	// campaigning again.
	mutantRunReturnsOnLoss
)
