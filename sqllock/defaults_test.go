package sqllock_test

import (
	"context"
	"testing"
	"time"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

// The README's defaults, literally: a Client with zero Options grants
// 30 s leases.
func TestDefaultTTLIs30s(t *testing.T) {
	c, err := sqllock.New(memory.New(), sqllock.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close(context.Background())
	g, err := c.TryAcquire(t.Context(), "k", nil)
	if err != nil {
		t.Fatal(err)
	}
	defer g.Release(context.Background())
	l := g.Lease()
	if got := l.Deadline.Sub(l.BackendTime); got != 30*time.Second {
		t.Fatalf("a zero Options grants %v, the README says 30s", got)
	}
}
