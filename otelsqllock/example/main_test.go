package main

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestRun runs the example and checks that what it prints holds the
// metrics and spans the otelsqllock package doc shows.
func TestRun(t *testing.T) {
	var out bytes.Buffer
	require.NoError(t, run(t.Context(), &out))
	for _, want := range []string{
		`"Name": "sqllock.acquire"`, `"Name": "sqllock.renew"`, `"Name": "sqllock.release"`,
		`"Name": "sqllock.acquire.duration"`, `"Name": "sqllock.renew.slack"`,
		`"Name": "sqllock.lease.hold.duration"`, `"Name": "sqllock.lease.active"`,
		`"Value": "held"`, `"Value": "nightly-report"`,
	} {
		require.Contains(t, out.String(), want)
	}
}
