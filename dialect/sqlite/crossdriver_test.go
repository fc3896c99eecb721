package sqlite

import (
	"database/sql"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // registers "pgx"
	_ "github.com/lib/pq"              // registers "postgres"
	"github.com/stretchr/testify/require"
)

// A PostgreSQL *sql.DB handed to New fails at once, before any I/O (the
// address below has no server), with an error that names the constructor
// to use.
func TestNewRefusesPostgresDB(t *testing.T) {
	t.Parallel()
	for _, driver := range []string{"pgx", "postgres"} {
		t.Run(driver, func(t *testing.T) {
			t.Parallel()
			db, err := sql.Open(driver, "postgres://nobody@127.0.0.1:1/none?sslmode=disable&connect_timeout=30")
			require.NoError(t, err)
			defer db.Close()
			start := time.Now()
			_, err = New(db, Options{})
			require.ErrorContains(t, err, "postgres.NewDB")
			require.Less(t, time.Since(start), time.Second, "New tried the server")
			require.Zero(t, db.Stats().OpenConnections, "New opened a connection")
		})
	}
}
