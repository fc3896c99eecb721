package postgres_test

import (
	"context"
	"database/sql"
	"log"
	"os"
	"os/exec"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/dialect/postgres"
	"github.com/ashlock/ashlock/internal/testkit/pgtest"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// A client on the application's own pool. The lock table comes from the
// migrations package or `sqllock migrate up`.
func Example() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	backend, err := postgres.New(pool, postgres.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer backend.Close() // before pool.Close: stops the listener

	client, err := sqllock.New(backend, sqllock.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close(ctx)

	err = client.Do(ctx, "reports/daily", nil, func(ctx context.Context, g *sqllock.Guard) error {
		// ctx ends if the lease is lost; pass g.Token() to the resources
		// you write, so they can refuse a stale holder.
		return nil
	})
	if err != nil {
		log.Fatal(err)
	}
}

// A write to a table in the same database that commits only while the
// lease is held: no one else can be granted the key until it commits.
func ExampleBackend_FencedTx() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	backend, err := postgres.New(pool, postgres.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer backend.Close()

	lease, err := backend.TryAcquire(ctx, sqllock.AcquireRequest{Key: "invoices/42", TTL: sqllock.DefaultTTL, Owner: "worker-1"})
	if err != nil {
		log.Fatal(err) // errors.Is(err, sqllock.ErrNotAcquired) when held
	}
	defer backend.Release(ctx, lease)

	err = backend.FencedTx(ctx, lease, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, "UPDATE invoices SET state = 'sent' WHERE id = 42")
		return err
	})
	if err != nil {
		log.Fatal(err) // errors.Is(err, sqllock.ErrLeaseLost): nothing was written
	}
}

// A Backend on the application's *sql.DB (here pgx's stdlib driver, as
// GORM, sqlx, ent and bun open it; lib/pq works too), and a transaction of
// that *sql.DB fenced by the lease: its writes commit only while the lease
// holds.
func ExampleBackend_FencedSQLTx() {
	ctx := context.Background()
	db, err := sql.Open("pgx", os.Getenv("DATABASE_URL")) // or your ORM's *sql.DB
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()
	backend, err := postgres.NewDB(db, postgres.Options{}) // never closes db
	if err != nil {
		log.Fatal(err)
	}
	defer backend.Close()

	lease, err := backend.TryAcquire(ctx, sqllock.AcquireRequest{Key: "invoices/43", TTL: sqllock.DefaultTTL, Owner: "worker-1"})
	if err != nil {
		log.Fatal(err) // errors.Is(err, sqllock.ErrNotAcquired) when held
	}
	defer backend.Release(ctx, lease)

	err = backend.FencedSQLTx(ctx, lease, func(tx *sql.Tx) error {
		_, err := tx.ExecContext(ctx, "UPDATE invoices SET state = 'sent' WHERE id = 43")
		return err
	})
	if err != nil {
		log.Fatal(err) // errors.Is(err, sqllock.ErrLeaseLost): nothing was written
	}
}

// TestExamples runs the examples above on the PostgreSQL harness's server,
// with DATABASE_URL naming a migrated schema, and checks what they did. They
// have no Output comment because go test's example runner has no server to
// give them; without this test they would only be compiled. Each runs in a
// child process (this test binary again), so that an example's log.Fatal
// fails the test instead of ending the binary before the server is stopped.
func TestExamples(t *testing.T) {
	examples := map[string]func(){
		"Example":                    Example,
		"ExampleBackend_FencedTx":    ExampleBackend_FencedTx,
		"ExampleBackend_FencedSQLTx": ExampleBackend_FencedSQLTx,
	}
	if name := os.Getenv(exampleEnv); name != "" {
		examples[name]() // the child
		return
	}
	db := pgtest.New(t)
	ctx := t.Context()
	sqlDB := stdlib.OpenDBFromPool(db.Pool)
	defer sqlDB.Close()
	require.NoError(t, migrations.Up(ctx, migrations.Postgres, sqlDB, migrations.Options{Schema: db.Schema}))
	_, err := db.Pool.Exec(ctx, `CREATE TABLE invoices (id int PRIMARY KEY, state text NOT NULL);
		INSERT INTO invoices VALUES (42, 'draft'), (43, 'draft')`)
	require.NoError(t, err)

	run := func(t *testing.T, name string) {
		t.Helper()
		cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestExamples$", "-test.count=1")
		cmd.Env = append(os.Environ(), exampleEnv+"="+name, "DATABASE_URL="+db.URL)
		out, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s failed:\n%s", name, out)
	}
	// lock returns the key's token and whether it is held.
	lock := func(t *testing.T, key string) (token int64, held bool) {
		t.Helper()
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT token, held FROM sqllock_locks WHERE key = $1`, key).Scan(&token, &held))
		return token, held
	}

	t.Run("Example", func(t *testing.T) {
		run(t, "Example")
		token, held := lock(t, "reports/daily")
		require.EqualValues(t, 1, token, "granted once")
		require.False(t, held, "released by Do")
	})

	t.Run("Backend_FencedTx", func(t *testing.T) {
		run(t, "ExampleBackend_FencedTx")
		var state string
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT state FROM invoices WHERE id = 42`).Scan(&state))
		require.Equal(t, "sent", state, "the fenced write committed")
		token, held := lock(t, "invoices/42")
		require.EqualValues(t, 1, token)
		require.False(t, held)
	})

	t.Run("Backend_FencedSQLTx", func(t *testing.T) {
		run(t, "ExampleBackend_FencedSQLTx")
		var state string
		require.NoError(t, db.Pool.QueryRow(ctx, `SELECT state FROM invoices WHERE id = 43`).Scan(&state))
		require.Equal(t, "sent", state, "the fenced write committed")
		token, held := lock(t, "invoices/43")
		require.EqualValues(t, 1, token)
		require.False(t, held)
	})
}

// exampleEnv names the example a child process of TestExamples runs.
const exampleEnv = "SQLLOCK_TEST_EXAMPLE"
