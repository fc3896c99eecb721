package sqllock_test

import (
	"context"
	"errors"
	"fmt"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

// Take two accounts together, all or none; each key has its own fencing
// token for its own resource.
func ExampleClient_AcquireAll() {
	ctx := context.Background()
	client, err := sqllock.New(memory.New(), sqllock.Options{Owner: "transfer"})
	if err != nil {
		panic(err)
	}
	defer client.Close(ctx)

	set, err := client.AcquireAll(ctx, []string{"account:42", "account:17"}, nil)
	if err != nil {
		panic(err)
	}
	for _, g := range set.Guards() {
		fmt.Println(g.Key(), "token", g.Token())
	}

	// A set that overlaps a held key is refused as a whole, naming it.
	_, err = client.AcquireAll(ctx, []string{"account:99", "account:17"}, nil)
	var he *sqllock.HeldError
	fmt.Println(errors.As(err, &he), he.Key)
	// account:99 was not taken either.
	g, err := client.TryAcquire(ctx, "account:99", nil)
	fmt.Println(err, g.Token())

	_ = set.Release(ctx)
	_ = g.Release(ctx)
	// Output:
	// account:42 token 1
	// account:17 token 1
	// true account:17
	// <nil> 1
}
