package sqlite_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/ashlock/ashlock/dialect/sqlite"
	"github.com/ashlock/ashlock/sqllock"
)

// Every process of the host that opens the same file shares the locks.
func Example() {
	dir, err := os.MkdirTemp("", "ashlock-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)

	backend, err := sqlite.Open(filepath.Join(dir, "locks.db"), sqlite.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer backend.Close()
	client, err := sqllock.New(backend, sqllock.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer client.Close(context.Background())

	ctx := context.Background()
	for range 2 {
		err = client.Do(ctx, "reports/daily", nil, func(ctx context.Context, g *sqllock.Guard) error {
			// Pass g.Token() to the resource you write, so that it can
			// refuse a stale holder.
			fmt.Println("holding", g.Key(), "with token", g.Token())
			return nil
		})
		if err != nil {
			log.Fatal(err)
		}
	}
	// Output:
	// holding reports/daily with token 1
	// holding reports/daily with token 2
}
