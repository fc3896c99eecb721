package sqllock_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

func ExampleClient_AcquirePermit() {
	ctx := context.Background()
	client, err := sqllock.New(memory.New(), sqllock.Options{Owner: "worker"})
	if err != nil {
		panic(err)
	}
	defer client.Close(ctx)

	// The three permits of "reports".
	a, _ := client.AcquirePermit(ctx, "reports", 3, nil)
	b, _ := client.AcquirePermit(ctx, "reports", 3, nil)
	c, _ := client.AcquirePermit(ctx, "reports", 3, nil)
	// Each is a lease of its own key: fence the resource per permit.
	fmt.Println(a.Key(), b.Key(), c.Key())

	_, err = client.AcquirePermit(ctx, "reports", 3, nil) // no Wait: one attempt
	var full *sqllock.PermitsHeldError
	fmt.Println(errors.As(err, &full), len(full.Holders))

	_, err = client.AcquirePermit(ctx, "reports", 4, nil) // the limit is the semaphore's
	fmt.Println(errors.Is(err, sqllock.ErrPermitLimit))

	b.Release(ctx)
	d, _ := client.AcquirePermit(ctx, "reports", 3, nil)
	fmt.Println(d.Key(), d.Token() > b.Token())
	// Output:
	// reports#permit-1 reports#permit-2 reports#permit-3
	// true 3
	// true
	// reports#permit-2 true
}
