//go:build !sqllock_mutants

package sqllock

// Deliberately broken behaviours of the client exist only in builds with
// the sqllock_mutants tag, for the simulation's checker-sensitivity test
// (see mutants_on.go). In every other build mutantOn is a constant false
// and the compiler removes the code behind it.

func mutantOn(mutant) bool { return false }
