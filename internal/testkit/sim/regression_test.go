package sim_test

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

// Regression tests for core bugs the simulation found: each was an anomaly
// on the seeds named in its comment until sqllock's Guard.Release
// cancelled the guard's context before calling the backend.

// slowRelease applies a release at once, but its reply takes delay.
type slowRelease struct {
	*memory.Backend
	delay time.Duration
}

func (s slowRelease) Release(ctx context.Context, l sqllock.Lease) error {
	err := s.Backend.Release(ctx, l)
	time.Sleep(s.delay)
	return err
}

func newClient(t *testing.T, b sqllock.Backend, owner string) *sqllock.Client {
	t.Helper()
	c, err := sqllock.New(b, sqllock.Options{Owner: owner, TTL: 3 * time.Second, Margin: 100 * time.Millisecond,
		Backoff: func(int) time.Duration { return 100 * time.Millisecond }})
	require.NoError(t, err)
	return c
}

// TestRegressionGuardOutlivesItsRelease (found by TestSim on seeds 0, 1, 2,
// 3, 8, 11): while Release was in flight the backend had already freed the
// key and another client held it, but the releasing guard's context was
// still valid, so a goroutine of the old holder that watched g.Context()
// kept working beside the new holder.
func TestRegressionGuardOutlivesItsRelease(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memory.New()
		a, b := newClient(t, slowRelease{mem, time.Second}, "a"), newClient(t, mem, "b")
		g, err := a.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		done := make(chan error, 1)
		go func() { done <- g.Release(t.Context()) }()
		synctest.Wait() // applied at the backend; the reply is on its way
		gb, err := b.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		defer func() { require.NoError(t, gb.Release(context.Background())) }()
		defer func() { require.NoError(t, <-done) }()
		require.Error(t, g.Context().Err(), "a's guard must not be valid while b holds the key")
	})
}

// TestRegressionReleaseDelaysCancelPastLocalDeadline (found by TestSim on
// seeds 19, 29, 34, 38, 113): Release stopped the expiry timer and
// cancelled the context only when the backend call returned, so a slow
// release kept the context valid past the guard's local deadline (G3).
func TestRegressionReleaseDelaysCancelPastLocalDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memory.New()
		a := newClient(t, slowRelease{mem, 2 * time.Second}, "a")
		g, err := a.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		deadline := g.LocalDeadline()
		time.Sleep(time.Until(deadline) - 500*time.Millisecond)
		done := make(chan error, 1)
		go func() { done <- g.Release(t.Context()) }()
		time.Sleep(time.Until(deadline))
		synctest.Wait()
		defer func() { <-done }()
		require.Error(t, g.Context().Err(), "the guard's context must not be valid after its local deadline")
	})
}
