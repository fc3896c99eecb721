package sqllock_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

func newPermitClient(t *testing.T, b sqllock.Backend, opts sqllock.Options) *sqllock.Client {
	t.Helper()
	c, err := sqllock.New(b, opts)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return c
}

// TestAcquirePermitUpToLimit: n Guards hold the n permits, each under its
// own key with its own token; with no Wait the next call is one attempt,
// refused with every holder named.
func TestAcquirePermitUpToLimit(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		c := newPermitClient(t, memory.New(), sqllock.Options{})
		ctx := t.Context()
		g1, err := c.AcquirePermit(ctx, "reports", 2, nil)
		require.NoError(t, err)
		g2, err := c.AcquirePermit(ctx, "reports", 2, nil)
		require.NoError(t, err)
		require.NotEqual(t, g1.Key(), g2.Key())
		for _, g := range []*sqllock.Guard{g1, g2} {
			sem, _, ok := sqllock.ParsePermitKey(g.Key())
			require.True(t, ok, g.Key())
			require.Equal(t, "reports", sem)
			require.Positive(t, g.Token())
		}
		_, err = c.AcquirePermit(ctx, "reports", 2, nil)
		var pe *sqllock.PermitsHeldError
		require.ErrorIs(t, err, sqllock.ErrNotAcquired)
		require.ErrorAs(t, err, &pe)
		require.Len(t, pe.Holders, 2)
		// The permits are renewed like any lease: still held after many TTLs.
		time.Sleep(5 * sqllock.DefaultTTL)
		require.NoError(t, g1.Err())
		require.NoError(t, g2.Err())
		require.NoError(t, g1.Release(ctx))
		g3, err := c.AcquirePermit(ctx, "reports", 2, nil)
		require.NoError(t, err)
		require.Equal(t, g1.Key(), g3.Key())
		require.Greater(t, g3.Token(), g1.Token())
	})
}

// TestAcquirePermitWaitWakesOnRelease: a waiting AcquirePermit is woken by
// the release of any permit, not by its backoff (an hour here) nor by the
// holders' deadlines (a minute).
func TestAcquirePermitWaitWakesOnRelease(t *testing.T) {
	t.Parallel()
	c := newPermitClient(t, memory.New(), sqllock.Options{TTL: time.Minute, Backoff: func(int) time.Duration { return time.Hour }})
	ctx := t.Context()
	g1, err := c.AcquirePermit(ctx, "sem", 2, nil)
	require.NoError(t, err)
	g2, err := c.AcquirePermit(ctx, "sem", 2, nil)
	require.NoError(t, err)
	defer g1.Release(ctx)
	got := make(chan *sqllock.Guard, 1)
	go func() {
		g, err := c.AcquirePermit(ctx, "sem", 2, &sqllock.AcquireOptions{Wait: sqllock.WaitForever})
		if err != nil {
			t.Error(err)
		}
		got <- g
	}()
	time.Sleep(20 * time.Millisecond) // let it find both held and sleep
	require.NoError(t, g2.Release(ctx))
	select {
	case g := <-got:
		require.NotNil(t, g)
		require.Equal(t, g2.Key(), g.Key())
		require.Greater(t, g.Token(), g2.Token())
		require.NoError(t, g.Release(ctx))
	case <-time.After(5 * time.Second):
		t.Fatal("the waiting AcquirePermit was not woken by a permit's release")
	}
}

// TestAcquirePermitWaitBounded: a positive Wait ends with the refusal
// joined with context.DeadlineExceeded, having slept at most until the
// soonest holder's end between attempts.
func TestAcquirePermitWaitBounded(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		c := newPermitClient(t, memory.New(), sqllock.Options{})
		ctx := t.Context()
		_, err := c.AcquirePermit(ctx, "sem", 1, nil)
		require.NoError(t, err)
		start := time.Now()
		_, err = c.AcquirePermit(ctx, "sem", 1, &sqllock.AcquireOptions{Wait: 3 * time.Second})
		require.ErrorIs(t, err, sqllock.ErrNotAcquired)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.Equal(t, 3*time.Second, time.Since(start))
	})
}

// counting is a backend that counts the permit acquires that reach it.
type counting struct {
	*memory.Backend
	permits atomic.Int64
}

func (c *counting) TryAcquirePermit(ctx context.Context, req sqllock.PermitRequest) (sqllock.Lease, error) {
	c.permits.Add(1)
	return c.Backend.TryAcquirePermit(ctx, req)
}

// TestAcquirePermitBadInput: bad input is refused by the Client before
// the backend is called, with the typed errors.
func TestAcquirePermitBadInput(t *testing.T) {
	t.Parallel()
	b := &counting{Backend: memory.New()}
	c := newPermitClient(t, b, sqllock.Options{})
	ctx := t.Context()
	for _, tc := range []struct {
		key  string
		n    int
		opts *sqllock.AcquireOptions
		want error
	}{
		{"sem", 0, nil, sqllock.ErrInvalidPermits},
		{"sem", sqllock.MaxPermits + 1, nil, sqllock.ErrInvalidPermits},
		{sqllock.PermitKey("sem", 1), 2, nil, sqllock.ErrInvalidKey},
		{sqllock.LimitKey("sem"), 2, nil, sqllock.ErrInvalidKey},
		{"", 2, nil, sqllock.ErrInvalidKey},
		{"sem", 2, &sqllock.AcquireOptions{MinHold: time.Minute}, sqllock.ErrMinHoldUnsupported},
	} {
		_, err := c.AcquirePermit(ctx, tc.key, tc.n, tc.opts)
		require.ErrorIs(t, err, tc.want, "%q %d", tc.key, tc.n)
	}
	require.Zero(t, b.permits.Load(), "bad input reached the backend")
}

// noPermits is a backend without the PermitAcquirer capability.
type noPermits struct{ sqllock.Backend }

// TestAcquirePermitUnsupported: a backend without PermitAcquirer gives an
// UnsupportedError naming it.
func TestAcquirePermitUnsupported(t *testing.T) {
	t.Parallel()
	c := newPermitClient(t, noPermits{memory.New()}, sqllock.Options{BackendName: "tape"})
	_, err := c.AcquirePermit(t.Context(), "sem", 2, nil)
	var ue *sqllock.UnsupportedError
	require.ErrorIs(t, err, sqllock.ErrUnsupported)
	require.ErrorAs(t, err, &ue)
	require.Equal(t, "tape", ue.Backend)
	require.Contains(t, err.Error(), "tape")
}

// TestAcquirePermitLimitDisagrees: a Client asking for another limit than
// the semaphore's is refused with the stored limit.
func TestAcquirePermitLimitDisagrees(t *testing.T) {
	t.Parallel()
	c := newPermitClient(t, memory.New(), sqllock.Options{})
	ctx := t.Context()
	g, err := c.AcquirePermit(ctx, "sem", 3, nil)
	require.NoError(t, err)
	defer g.Release(ctx)
	_, err = c.AcquirePermit(ctx, "sem", 4, &sqllock.AcquireOptions{Wait: time.Second})
	var le *sqllock.PermitLimitError
	require.ErrorAs(t, err, &le)
	require.Equal(t, 3, le.Stored)
}

// TestAcquirePermitLossReported: a permit taken over after its expiry is
// a loss to its Guard, as for any lease.
func TestAcquirePermitLossReported(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b := memory.New()
		c := newPermitClient(t, b, sqllock.Options{})
		ctx := t.Context()
		g, err := c.AcquirePermit(ctx, "sem", 1, nil)
		require.NoError(t, err)
		b.Expire(g.Key())
		other := newPermitClient(t, b, sqllock.Options{})
		g2, err := other.AcquirePermit(ctx, "sem", 1, nil)
		require.NoError(t, err)
		<-g.Done()
		var lost *sqllock.LostError
		require.ErrorAs(t, context.Cause(g.Context()), &lost)
		require.Equal(t, sqllock.LostTaken, lost.Reason)
		require.NoError(t, g2.Release(ctx))
		require.True(t, errors.Is(g.Err(), sqllock.ErrLeaseLost))
	})
}
