// Package integration holds tests against real databases and real
// processes: faults, restarts, partitions, multi-process SQLite.
package integration

import (
	"fmt"
	"os"
	"testing"

	"go.uber.org/goleak"

	"github.com/ashlock/ashlock/internal/testkit/pgtest"
)

// TestMain is the package's only TestMain: it stops the shared PostgreSQL
// server (if pgtest started one) and then checks that no goroutine leaked.
func TestMain(m *testing.M) {
	code := pgtest.Main(m)
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
			code = 1
		}
	}
	os.Exit(code)
}
