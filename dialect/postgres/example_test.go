package postgres_test

import (
	"context"
	"log"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ashlock/ashlock/dialect/postgres"
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
