package mariadb

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/mariaserver"
	"github.com/ashlock/ashlock/internal/testkit/mariatest"
	"github.com/ashlock/ashlock/migrations"
)

// A server that does not flush its log at every commit can lose reported
// grants in a machine crash: New refuses it unless told otherwise.
func TestNewRefusesNonDurableServer(t *testing.T) {
	s := mariatest.Dedicated(t, mariaserver.Options{Durable: false})
	db := mariatest.Open(t, s.Addr, "mysql")
	_, err := New(db, Options{})
	require.ErrorIs(t, err, ErrNotDurable)
	b, err := New(db, Options{AllowNonDurable: true})
	require.NoError(t, err)
	require.NoError(t, b.Close())
}

// MySQL (no RETURNING) and MariaDB before 10.6 (no JSON_TABLE) are refused.
func TestCheckVersion(t *testing.T) {
	for v, ok := range map[string]bool{
		"10.11.19-MariaDB-0+deb12u1": true,
		"11.4.2-MariaDB":             true,
		"10.6.0-MariaDB":             true,
		"10.5.23-MariaDB":            false,
		"8.0.36":                     false,
		"8.4.0-commercial":           false,
		"":                           false,
	} {
		err := checkVersion(v)
		if ok {
			require.NoError(t, err, v)
		} else {
			require.ErrorIs(t, err, ErrUnsupportedServer, v)
		}
	}
}

// Bad options are refused before any I/O (New is given no handle that
// could answer).
func TestOptionsRefusedBeforeIO(t *testing.T) {
	_, err := New(nil, Options{})
	require.Error(t, err)
	for _, o := range []Options{{Table: "bad-name"}, {Table: "x; DROP TABLE y"}, {LockWait: -time.Second}, {LockWait: 2 * time.Hour}} {
		_, err := o.resolve()
		require.Error(t, err, "%+v", o)
	}
	_, err = Options{Table: "bad-name"}.resolve()
	require.ErrorIs(t, err, migrations.ErrInvalidIdentifier)
	o, err := Options{LockWait: 1500 * time.Millisecond}.resolve()
	require.NoError(t, err)
	require.Equal(t, "2", o.lockWaitSeconds())
}
