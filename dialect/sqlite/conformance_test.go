package sqlite

import (
	"database/sql"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
	"github.com/ashlock/ashlock/sqllock/backendtest"
)

func TestConformance(t *testing.T) {
	t.Parallel()
	backendtest.Run(t, backendtest.Harness{
		New: func(t *testing.T) sqllock.Backend {
			b, _ := openTest(t, Options{})
			return b
		},
		Expire: func(t *testing.T, b sqllock.Backend, key string) {
			execTest(t, b, expireSQL, key)
		},
		SetToken: func(t *testing.T, b sqllock.Backend, key string, token int64) {
			execTest(t, b, setTokenSQL, key, token)
		},
		Shared: true,
	})
}

// TestConformanceNew runs the suite on an application's own *sql.DB (a pool
// of 4 built with DSN, a non-default table, migrated explicitly).
func TestConformanceNew(t *testing.T) {
	t.Parallel()
	backendtest.Run(t, backendtest.Harness{
		New: func(t *testing.T) sqllock.Backend {
			const table = "app_locks"
			name, err := DSN(filepath.Join(t.TempDir(), "app.db"), Options{Synchronous: SynchronousNormal})
			require.NoError(t, err)
			db, err := sql.Open("sqlite", name)
			require.NoError(t, err)
			db.SetMaxOpenConns(4)
			t.Cleanup(func() { require.NoError(t, db.Close()) })
			require.NoError(t, migrations.Up(testCtx(t), migrations.SQLite, db, migrations.Options{Table: table}))
			b, err := New(db, Options{Table: table})
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, b.Close()) })
			return b
		},
		Expire: func(t *testing.T, b sqllock.Backend, key string) {
			execTest(t, b, expireSQL, key)
		},
		SetToken: func(t *testing.T, b sqllock.Backend, key string, token int64) {
			execTest(t, b, setTokenSQL, key, token)
		},
		Shared: true,
	})
}

func FuzzSQLite(f *testing.F) {
	b, _ := openTest(f, Options{})
	backendtest.Fuzz(f, b)
}
