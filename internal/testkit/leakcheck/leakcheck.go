// Package leakcheck checks, at the end of a test binary, that no goroutine
// outlived its test. It wraps go.uber.org/goleak with a longer patience:
// goleak gives up after about 0.4 s, while a connection pool or listener
// closed by the last test's cleanup may still be winding down on a loaded
// machine.
package leakcheck

import (
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// Patience is how long Find waits for goroutines to end.
const Patience = 10 * time.Second

// Find returns nil once no unexpected goroutine is left, or goleak's report
// of the ones still running after Patience.
func Find(opts ...goleak.Option) error {
	return FindWithin(Patience, opts...)
}

// FindWithin is Find with a patience of d.
func FindWithin(d time.Duration, opts ...goleak.Option) error {
	deadline := time.Now().Add(d)
	for {
		err := goleak.Find(opts...)
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// VerifyTestMain runs the tests and, when they pass, Find; it exits with
// a failure if goroutines leaked. Use it as TestMain's body.
func VerifyTestMain(m *testing.M, opts ...goleak.Option) {
	os.Exit(Check(m.Run(), opts...))
}

// Check returns code, or 1 if code is 0 and goroutines leaked (reported
// on stderr).
func Check(code int, opts ...goleak.Option) int {
	if code != 0 {
		return code
	}
	if err := Find(opts...); err != nil {
		fmt.Fprintf(os.Stderr, "goleak: %v\n", err)
		return 1
	}
	return 0
}
