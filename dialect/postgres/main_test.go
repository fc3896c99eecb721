package postgres

import (
	"cmp"
	"context"
	"log/slog"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/leakcheck"
	"github.com/ashlock/ashlock/internal/testkit/pgtest"
	"github.com/ashlock/ashlock/migrations"
)

func TestMain(m *testing.M) {
	code := pgtest.Main(m)
	// Every Backend is closed and every pool closed by t.Cleanup: no
	// listener or pgxpool goroutine may be left.
	os.Exit(leakcheck.Check(code))
}

// testBundle is one test's schema, with the lock table migrated, and a
// Backend on it.
type testBundle struct {
	db      *pgtest.DB
	backend *Backend
}

// newBundle creates a fresh schema with the lock table (as opts names it)
// and a Backend on it, closed in t.Cleanup before the pool.
func newBundle(t testing.TB, opts Options) *testBundle {
	t.Helper()
	return newBundleIn(t, pgtest.New(t), opts)
}

// newBundleIn is newBundle on db.
func newBundleIn(t testing.TB, db *pgtest.DB, opts Options) *testBundle {
	t.Helper()
	sqlDB := stdlib.OpenDBFromPool(db.Pool)
	defer sqlDB.Close()
	// Naming the test's schema (which is also the pool's search_path) gives
	// each test its own migration lock, so parallel tests do not queue.
	mo := migrations.Options{Schema: cmp.Or(opts.Schema, db.Schema), Table: opts.Table}
	err := migrations.Up(testCtx(t), migrations.Postgres, sqlDB, mo)
	require.NoError(t, err)
	if opts.Logger == nil {
		// The listener's reconnects show up in the failing test's output.
		opts.Logger = slog.New(slog.NewTextHandler(t.Output(), nil))
	}
	b, err := New(db.Pool, opts)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, b.Close()) })
	return &testBundle{db: db, backend: b}
}

// schemaAt makes a fresh schema migrated up to version, as a release
// that far left it, for an upgrade test; upgrade applies the remaining
// migrations.
func schemaAt(t *testing.T, version int64) (db *pgtest.DB, upgrade func()) {
	t.Helper()
	db = pgtest.New(t)
	sqlDB := stdlib.OpenDBFromPool(db.Pool)
	t.Cleanup(func() { sqlDB.Close() })
	mo := migrations.Options{Schema: db.Schema}
	p, err := migrations.NewProvider(migrations.Postgres, sqlDB, mo)
	require.NoError(t, err)
	_, err = p.UpTo(testCtx(t), version)
	require.NoError(t, err)
	return db, func() {
		t.Helper()
		require.NoError(t, migrations.Up(testCtx(t), migrations.Postgres, sqlDB, mo))
	}
}

// newPool opens a pool on bundle's schema, its configuration parsed from
// the bundle's URL and then changed by configure (if not nil), closed in
// t.Cleanup.
func newPool(t testing.TB, bundle *testBundle, configure func(*pgxpool.Config)) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(bundle.db.URL)
	require.NoError(t, err)
	if configure != nil {
		configure(cfg)
	}
	pool, err := pgxpool.NewWithConfig(testCtx(t), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	return pool
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	return ctx
}
