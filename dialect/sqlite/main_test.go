package sqlite

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"text/template"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/sqlident"
	"github.com/ashlock/ashlock/internal/testkit/leakcheck"
	"github.com/ashlock/ashlock/sqllock"
)

func TestMain(m *testing.M) {
	if os.Getenv(helperEnv) != "" {
		os.Exit(helperMain())
	}
	code := m.Run()
	os.Exit(leakcheck.Check(code))
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// openTest opens a Backend on a fresh file in t.TempDir().
func openTest(t testing.TB, opts Options) (*Backend, string) {
	t.Helper()
	path := filepath.Join(t.TempDir(), "locks.db")
	b, err := Open(path, opts)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, b.Close()) })
	return b, path
}

// The tests' own statements, testdata/queries/*.sql, rendered by execTest
// with the Backend's vocabulary (they may use the templates of queries/).
var testTemplates = template.Must(template.Must(queryTemplates.Clone()).ParseGlob(filepath.Join("testdata", "queries", "*.sql")))

const (
	expireSQL   = "expire"    // testdata/queries/expire.sql
	setTokenSQL = "set_token" // testdata/queries/set_token.sql
)

// execTest runs the test statement name (expireSQL, setTokenSQL) on b's
// table. It bypasses the Backend's write slot, so a writer of the Backend
// (a reaper's transaction, say) may hold the database: SQLITE_BUSY is
// waited out, as the Backend itself does.
func execTest(t testing.TB, b sqllock.Backend, name string, args ...any) {
	t.Helper()
	sb := b.(*Backend)
	query := fill(testTemplates, name, holes{Table: sqlident.QuoteSQLite(sb.table), Now: nowMS})
	ctx := testCtx(t)
	for {
		_, err := sb.db.ExecContext(ctx, query, args...)
		if isBusy(err) && ctx.Err() == nil {
			time.Sleep(time.Millisecond)
			continue
		}
		require.NoError(t, err)
		return
	}
}
