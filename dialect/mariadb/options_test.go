package mariadb

import (
	"context"
	"database/sql"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/mariaserver"
	"github.com/ashlock/ashlock/internal/testkit/mariatest"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
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

// TestLockWaitBoundsAStatement: a statement waits for a row lock at most
// Options.LockWait, whether each statement sets it (the session's
// innodb_lock_wait_timeout is the server's 50 s) or the session has it
// already (the DSN sets it, and no statement does): behind a transaction
// that holds the key's row, an acquire fails as unavailable after about
// 1 s, applying nothing.
func TestLockWaitBoundsAStatement(t *testing.T) {
	for _, tc := range []struct {
		name, dsn string
		prefixed  bool
	}{
		{name: "EachStatement", prefixed: true},
		{name: "Session", dsn: "&innodb_lock_wait_timeout=1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			s := mariatest.Server(t)
			name := mariatest.Database(t, s)
			db, err := sql.Open("mysql", mariatest.DSN(s.Addr, name)+tc.dsn)
			require.NoError(t, err)
			t.Cleanup(func() { db.Close() })
			migrated(t, db, Options{})
			b, err := New(db, Options{LockWait: time.Second})
			require.NoError(t, err)
			t.Cleanup(func() { b.Close() })
			require.Equal(t, tc.prefixed, strings.HasPrefix(b.acquireSQL, "SET STATEMENT"), "%s", b.acquireSQL)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			l, err := b.TryAcquire(ctx, acq("k"))
			require.NoError(t, err)

			other := mariatest.Open(t, s.Addr, name)
			tx, err := other.BeginTx(ctx, nil)
			require.NoError(t, err)
			defer tx.Rollback()
			_, err = tx.ExecContext(ctx, "SELECT token FROM "+quotedTable(b)+" WHERE `key` = 'k' FOR UPDATE")
			require.NoError(t, err)
			start := time.Now()
			_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o2"})
			require.ErrorIs(t, err, sqllock.ErrUnavailable)
			require.Less(t, time.Since(start), 5*time.Second)
			require.NoError(t, tx.Rollback())
			_, err = b.TryRenew(ctx, l, time.Minute)
			require.NoError(t, err, "the refused acquire applied nothing")
		})
	}
}
