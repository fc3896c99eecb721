package sqllock

// mutant names a deliberately broken behaviour of the client (see
// mutants_off.go and mutants_on.go).
type mutant int32

const (
	// mutantDeadlineFromReply computes the guard's local deadline from the
	// time the reply arrived instead of the time the request was sent.
	mutantDeadlineFromReply mutant = iota + 1
	// mutantGuardIgnoresLoss keeps a guard alive when a renewal reports the
	// lease lost (it is still cancelled at its local deadline).
	mutantGuardIgnoresLoss
	// mutantBatchDeadlineFromReply computes the local deadlines of the
	// guards renewed by a batch from the time the batch's reply arrived
	// instead of the time it was sent.
	mutantBatchDeadlineFromReply
	// mutantRenewUnbounded lets a renewal attempt run until the latest
	// local deadline of its leases, as before attempts were bounded: one
	// call that never returns costs every lease it carries.
	mutantRenewUnbounded
)
