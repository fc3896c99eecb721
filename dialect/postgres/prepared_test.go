package postgres

import (
	"fmt"
	"testing"

	"github.com/lib/pq"
	"github.com/stretchr/testify/require"
)

// A prepared statement is prepared again and sent once more only after
// the server refused to bind it, before it ran: it lost the statement
// (26000), or its cached plan no longer fits (0A000 with that message);
// never after another error of the same class, a cancel, a conflict or a
// broken connection.
func TestLostStatement(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		err  error
		lost bool
	}{
		{&pq.Error{Code: "26000", Message: `prepared statement "3" does not exist`}, true},
		{fmt.Errorf("wrapped: %w", &pq.Error{Code: "26000", Message: `prepared statement "3" does not exist`}), true},
		{&pq.Error{Code: "0A000", Message: "cached plan must not change result type"}, true},
		{&pq.Error{Code: "0A000", Message: "FOR UPDATE is not allowed with aggregate functions"}, false},
		{&pq.Error{Code: "57014", Message: "canceling statement due to user request"}, false},
		{&pq.Error{Code: "40001", Message: "could not serialize access"}, false},
		{fmt.Errorf("read: connection reset by peer"), false},
		{nil, false},
	} {
		require.Equal(t, tc.lost, lostStatement(tc.err), "%v", tc.err)
	}
}
