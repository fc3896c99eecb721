package sim_test

import (
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/ashlock/ashlock/internal/mutant"
)

func TestMain(m *testing.M) {
	// Every simulated client has an owner name of its own; the random
	// part of lease owners would make two runs of a seed differ.
	mutant.SetDeterministicOwners(true)
	code := m.Run()
	if code == 0 {
		if err := goleak.Find(); err != nil {
			os.Stderr.WriteString("goleak: " + err.Error() + "\n")
			code = 1
		}
	}
	os.Exit(code)
}
