package sqllock_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// stuckRenewals makes every renewal hang for d whatever its context says,
// as a backend that ignores cancellation would, and reports through the
// returned channel when the first one is in flight.
func stuckRenewals(tb *testBundle, d time.Duration) <-chan struct{} {
	inFlight := make(chan struct{})
	var once atomic.Bool
	tb.b.renew = func(ctx context.Context, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
		if !once.Swap(true) {
			close(inFlight)
		}
		time.Sleep(d)
		return tb.mem.TryRenew(context.Background(), l, ttl)
	}
	return inFlight
}

// Issue: Release waited for the watchdog unconditionally, so a renewal
// stuck in the backend held up Release (and Close, and Do) for as long as
// it hung, whatever their context. Release is bounded by its context; the
// lease is released at once, and the watchdog ends when the stuck call
// returns (goleak checks that it does).
func TestReleaseNotHeldUpByStuckRenewal(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		inFlight := stuckRenewals(tb, 3*time.Second)
		g, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		<-inFlight
		ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
		defer cancel()
		start := time.Now()
		err = g.Release(ctx)
		elapsed := time.Since(start)
		require.NoError(t, err)
		require.LessOrEqual(t, elapsed, 100*time.Millisecond, "Release outlived its context")
		require.False(t, held(t, tb.mem, "k"), "released at the backend")
		require.ErrorIs(t, g.Err(), sqllock.ErrReleased)
		time.Sleep(3 * time.Second) // the stuck renewal returns; the watchdog ends
	})
}

func TestCloseNotHeldUpByStuckRenewal(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		inFlight := stuckRenewals(tb, 3*time.Second)
		_, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		<-inFlight
		ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
		defer cancel()
		start := time.Now()
		require.NoError(t, tb.client.Close(ctx))
		require.LessOrEqual(t, time.Since(start), 100*time.Millisecond, "Close outlived its context")
		require.False(t, held(t, tb.mem, "k"))
		time.Sleep(3 * time.Second)
	})
}

func TestDoNotHeldUpByStuckRenewal(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{ReleaseTimeout: 200 * time.Millisecond})
		inFlight := stuckRenewals(tb, 3*time.Second)
		start := time.Now()
		var returned time.Time
		err := tb.client.Do(t.Context(), "k", nil, func(ctx context.Context, g *sqllock.Guard) error {
			<-inFlight
			returned = time.Now()
			return nil
		})
		require.NoError(t, err)
		require.LessOrEqual(t, time.Since(returned), 200*time.Millisecond, "Do's release outlived ReleaseTimeout (started %v)", start)
		require.False(t, held(t, tb.mem, "k"))
		time.Sleep(3 * time.Second)
	})
}

// unreachableReleases makes every release wait until its context ends and
// fail as a backend that cannot reach its database does.
func unreachableReleases(tb *testBundle) {
	tb.b.release = func(ctx context.Context, l sqllock.Lease) error {
		<-ctx.Done()
		return errors.Join(sqllock.ErrUnavailable, ctx.Err())
	}
}

// pollingReleases makes every release poll its context's Err, never asking
// for its Done channel, until it ends (for at most 10 s), and fail as a
// backend that cannot reach its database does.
func pollingReleases(tb *testBundle) {
	tb.b.release = func(ctx context.Context, l sqllock.Lease) error {
		for start := time.Now(); ctx.Err() == nil && time.Since(start) < 10*time.Second; {
			time.Sleep(10 * time.Millisecond)
		}
		return errors.Join(sqllock.ErrUnavailable, ctx.Err())
	}
}

// Release is bounded by ReleaseTimeout, and by its context, also at a
// backend that only polls the context's Err (the release context makes
// its channel and timer only when asked for them).
func TestReleaseBoundedAtBackendThatPolls(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const timeout = time.Second
		tb := setup(t, sqllock.Options{ReleaseTimeout: timeout})
		pollingReleases(tb)
		for _, bound := range []time.Duration{timeout, timeout / 4} {
			g, err := tb.client.TryAcquire(t.Context(), "k", nil)
			require.NoError(t, err)
			// Bounded by ReleaseTimeout, or by a context cancelled (with
			// no deadline) before it.
			ctx, cancel := context.WithCancel(context.Background())
			want := context.Canceled
			if bound < timeout {
				time.AfterFunc(bound, cancel)
			} else {
				ctx, want = context.Background(), context.DeadlineExceeded
			}
			start := time.Now()
			err = g.Release(ctx)
			cancel()
			require.ErrorIs(t, err, want)
			require.LessOrEqual(t, time.Since(start), bound+10*time.Millisecond, "Release outlived its bound %v", bound)
			require.NoError(t, tb.mem.Release(context.Background(), g.Lease()))
		}
	})
}

// Issue: Close released its guards one after another, and once its context
// had ended each release got a fresh ReleaseTimeout: 5 guards on an
// unreachable database took 4.1 s with a 100 ms context. The releases run
// in parallel under one bound.
func TestCloseBoundedByItsContext(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		for _, k := range []string{"a", "b", "c", "d", "e"} {
			_, err := tb.client.TryAcquire(t.Context(), k, nil)
			require.NoError(t, err)
		}
		unreachableReleases(tb)
		ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
		defer cancel()
		start := time.Now()
		err := tb.client.Close(ctx)
		require.LessOrEqual(t, time.Since(start), 100*time.Millisecond, "Close outlived its context")
		require.ErrorIs(t, err, sqllock.ErrUnavailable)
		require.Equal(t, 5, tb.b.n("release"), "every guard's release was sent")
	})
}

// With a context that has already ended, Close still sends every release
// (docs/pitfalls.md#16), under one ReleaseTimeout for all of them.
func TestCloseWithEndedContextOneReleaseTimeout(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const timeout = time.Second
		tb := setup(t, sqllock.Options{ReleaseTimeout: timeout})
		for _, k := range []string{"a", "b", "c", "d", "e"} {
			_, err := tb.client.TryAcquire(t.Context(), k, nil)
			require.NoError(t, err)
		}
		unreachableReleases(tb)
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		start := time.Now()
		err := tb.client.Close(ctx)
		require.LessOrEqual(t, time.Since(start), timeout)
		require.ErrorIs(t, err, sqllock.ErrUnavailable)
		require.Equal(t, 5, tb.b.n("release"))
	})
}

// A second Release, while the first is still at the backend, is bounded by
// its own context too.
func TestConcurrentReleaseBoundedByItsContext(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		g, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		unreachableReleases(tb)
		first := make(chan error)
		go func() { first <- g.Release(t.Context()) }()
		synctest.Wait()
		ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
		defer cancel()
		start := time.Now()
		require.ErrorIs(t, g.Release(ctx), context.DeadlineExceeded)
		require.Equal(t, 100*time.Millisecond, time.Since(start))
		require.ErrorIs(t, <-first, sqllock.ErrUnavailable)
	})
}

// Issue (G6): an indeterminate acquire whose repeat is refused by a holder
// the backend cannot name (PostgreSQL, when the repeat lost the race for a
// new row to the lost attempt itself) is not settled as "not ours": the
// next repeat sees the row and gets the grant back.
func TestIndeterminateNotSettledByAnonymousRefusal(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		var calls atomic.Int64
		tb.b.acquire = func(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
			switch calls.Add(1) {
			case 1:
				_, err := tb.mem.TryAcquire(ctx, req)
				require.NoError(t, err)
				return sqllock.Lease{}, sqllock.ErrIndeterminate // applied, reply lost
			case 2:
				return sqllock.Lease{}, &sqllock.HeldError{Key: req.Key} // holder unseen
			}
			return tb.mem.TryAcquire(ctx, req)
		}
		g, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		require.EqualValues(t, 1, g.Token())
		require.NoError(t, g.Release(t.Context()))
	})
}
