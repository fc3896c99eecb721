package mariadb

import (
	"context"
	"errors"
	"net"
	"testing"

	"github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// The driver's errors in ashlock's vocabulary: what the server refused
// applied nothing; what broke in flight is indeterminate for an acquire
// or a release and merely unavailable for a renewal; a dial that failed
// sent nothing.
func TestClassify(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		op                         outcome.Op
		err                        error
		want                       []error
		indeterminate, unavailable bool
	}{
		{op: outcome.Acquire, err: &mysql.MySQLError{Number: 1146}, want: []error{sqllock.ErrSchemaMissing}},
		{op: outcome.Acquire, err: &mysql.MySQLError{Number: 1690}, want: []error{sqllock.ErrTokenExhausted}},
		{op: outcome.Renew, err: &mysql.MySQLError{Number: 1690}},
		{op: outcome.Acquire, err: &mysql.MySQLError{Number: 1213}, unavailable: true},
		{op: outcome.Release, err: &mysql.MySQLError{Number: 1205}, unavailable: true},
		{op: outcome.Acquire, err: &mysql.MySQLError{Number: 1644}},
		{op: outcome.Acquire, err: mysql.ErrInvalidConn, indeterminate: true, unavailable: true},
		{op: outcome.Release, err: mysql.ErrInvalidConn, indeterminate: true, unavailable: true},
		{op: outcome.Renew, err: mysql.ErrInvalidConn, unavailable: true},
		{op: outcome.Acquire, err: &net.OpError{Op: "dial", Err: errors.New("refused")}, unavailable: true},
	} {
		err := classify(ctx, tc.op, "k", tc.err)
		require.ErrorIs(t, err, tc.err, "%s %v: the driver's error is kept", tc.op, tc.err)
		for _, w := range tc.want {
			require.ErrorIs(t, err, w, "%s %v", tc.op, tc.err)
		}
		require.Equal(t, tc.indeterminate, errors.Is(err, sqllock.ErrIndeterminate), "%s %v: indeterminate", tc.op, tc.err)
		require.Equal(t, tc.unavailable, errors.Is(err, sqllock.ErrUnavailable), "%s %v: unavailable", tc.op, tc.err)
	}
}

// A deadlock's victim applied nothing: the statement is repeated, and the
// caller sees only the repeat's outcome.
func TestDeadlockRepeated(t *testing.T) {
	b := &Backend{}
	calls := 0
	err := b.run(context.Background(), outcome.Acquire, "k", func(context.Context) error {
		calls++
		if calls < 3 {
			return &mysql.MySQLError{Number: 1213, Message: "Deadlock found when trying to get lock"}
		}
		return nil
	})
	require.NoError(t, err)
	require.Equal(t, 3, calls)
	require.Equal(t, uint64(2), b.Stats().Deadlocks)

	calls = 0
	err = b.run(context.Background(), outcome.Acquire, "k", func(context.Context) error {
		calls++
		return &mysql.MySQLError{Number: 1213}
	})
	require.ErrorIs(t, err, sqllock.ErrUnavailable, "deadlocks without end: unavailable, never indeterminate")
	require.NotErrorIs(t, err, sqllock.ErrIndeterminate)
	require.Equal(t, deadlockRetries+1, calls)
}
