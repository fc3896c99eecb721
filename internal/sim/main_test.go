package sim_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/ashlock/ashlock/internal/mutant"
)

func TestMain(m *testing.M) {
	// Every simulated client has an owner name of its own; the random
	// part of lease owners would make two runs of a seed differ.
	mutant.SetDeterministicOwners(true)
	goleak.VerifyTestMain(m)
}
