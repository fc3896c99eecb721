package election_test

import (
	"context"
	"fmt"

	"github.com/ashlock/ashlock/election"
	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

// Two candidates for one name: the first leads term 1, resigns, and the
// second leads term 2, a greater term number (the lease's fencing token).
func Example() {
	ctx := context.Background()
	backend := memory.New() // or dialect/postgres, dialect/sqlite
	newCandidate := func(name string) *election.Election {
		c, err := sqllock.New(backend, sqllock.Options{Owner: name})
		if err != nil {
			panic(err)
		}
		e, err := election.New(c, election.Config{Name: "billing-scheduler"})
		if err != nil {
			panic(err)
		}
		return e
	}
	a, b := newCandidate("a"), newCandidate("b")

	l, err := a.Campaign(ctx)
	if err != nil {
		panic(err)
	}
	fmt.Println("a leads term", l.Term().Token)
	if err := l.Resign(ctx); err != nil {
		panic(err)
	}

	err = b.Run(ctx, func(ctx context.Context, t election.Term) error {
		fmt.Println("b leads term", t.Token)
		return nil // done: Run resigns and returns
	})
	fmt.Println("Run:", err)
	_, err = b.Leader(ctx)
	fmt.Println(err)
	// Output:
	// a leads term 1
	// b leads term 2
	// Run: <nil>
	// election: no leader for "billing-scheduler" (last term 2)
}
