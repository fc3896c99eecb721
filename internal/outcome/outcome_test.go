package outcome_test

import (
	"context"
	"errors"
	"io"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

const d = outcome.Dialect("sqllock/test")

// The operations whose failure in flight may have applied something that
// matters, and only those, are indeterminate.
func TestIndeterminate(t *testing.T) {
	for o, want := range map[outcome.Op]bool{
		outcome.Acquire:     true,
		outcome.Release:     true,
		outcome.Commit:      true,
		outcome.AcquireRead: false,
		outcome.Grant:       false,
		outcome.Renew:       false,
		outcome.List:        false,
		outcome.Fence:       false,
	} {
		require.Equal(t, want, o.Indeterminate(), "%s", o)
		if want {
			require.Equal(t, sqllock.ErrIndeterminate, o.Unknown(), "%s", o)
		} else {
			require.Equal(t, sqllock.ErrUnavailable, o.Unknown(), "%s", o)
		}
	}
	require.Equal(t, outcome.AcquireRead, outcome.Acquire.Read())
	require.Equal(t, outcome.Renew, outcome.Renew.Read())
}

// A request not sent because the caller's context ended is the context's
// error alone; one that could not be sent otherwise is unavailable. Neither
// is ever indeterminate, whatever the operation.
func TestNotSent(t *testing.T) {
	for _, o := range []outcome.Op{outcome.Acquire, outcome.Release, outcome.Commit, outcome.Renew, outcome.List} {
		err := d.NotSent(o, "k", true, context.Canceled)
		require.ErrorIs(t, err, context.Canceled)
		require.NotErrorIs(t, err, sqllock.ErrUnavailable, "%s: the caller gave up, the backend did not fail", o)
		require.NotErrorIs(t, err, sqllock.ErrIndeterminate, "%s", o)
		require.ErrorContains(t, err, `sqllock/test: `+string(o)+` "k": not sent`)

		dial := errors.New("dial: connection refused")
		err = d.NotSent(o, "k", false, dial)
		require.ErrorIs(t, err, dial)
		require.ErrorIs(t, err, sqllock.ErrUnavailable, "%s", o)
		require.NotErrorIs(t, err, sqllock.ErrIndeterminate, "%s", o)
	}
}

// A failure in flight: indeterminate for the operations that may have
// applied something (and unavailable too when the connection broke),
// unavailable for the others; the original error is kept.
func TestInFlight(t *testing.T) {
	for _, tc := range []struct {
		o                          outcome.Op
		ctxEnded                   bool
		indeterminate, unavailable bool
	}{
		{outcome.Acquire, true, true, false},
		{outcome.Acquire, false, true, true},
		{outcome.Release, true, true, false},
		{outcome.Commit, false, true, true},
		{outcome.Renew, true, false, true},
		{outcome.Renew, false, false, true},
		{outcome.Fence, true, false, true},
		{outcome.List, false, false, true},
	} {
		cause := io.ErrUnexpectedEOF
		if tc.ctxEnded {
			cause = context.DeadlineExceeded
		}
		err := d.InFlight(tc.o, "k", tc.ctxEnded, cause)
		require.ErrorIs(t, err, cause)
		require.Equal(t, tc.indeterminate, errors.Is(err, sqllock.ErrIndeterminate), "%s ctxEnded=%v: %v", tc.o, tc.ctxEnded, err)
		require.Equal(t, tc.unavailable, errors.Is(err, sqllock.ErrUnavailable), "%s ctxEnded=%v: %v", tc.o, tc.ctxEnded, err)
		require.ErrorContains(t, err, `sqllock/test: `+string(tc.o)+` "k": `)
	}
}
