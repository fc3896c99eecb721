//go:build !sqllock_mutants

package election

// Deliberately broken behaviours of the election exist only in builds with
// the sqllock_mutants tag, for the election simulation's
// checker-sensitivity test (see mutants_on.go). In every other build
// mutantOn is a constant false and the compiler removes the code behind it.

func mutantOn(mutant) bool { return false }
