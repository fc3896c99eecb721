package sqlite

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

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

func execTest(t testing.TB, b sqllock.Backend, query string, args ...any) {
	t.Helper()
	sb := b.(*Backend)
	_, err := sb.db.ExecContext(testCtx(t), render(query, `"`+sb.table+`"`, nowMS), args...)
	require.NoError(t, err)
}
