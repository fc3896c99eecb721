package sqllock_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// hangFirst returns a renewal call that hangs until its context ends for
// the first n calls (a half-open connection: the call is never answered,
// and the caller's cancellation discards the connection), then passes
// through to next; and the send times of every call.
func hangFirst[R any](n int, next func(ctx context.Context) (R, error)) (func(ctx context.Context) (R, error), func() []time.Time) {
	var mu sync.Mutex
	var sent []time.Time
	call := func(ctx context.Context) (R, error) {
		mu.Lock()
		sent = append(sent, time.Now())
		hang := len(sent) <= n
		mu.Unlock()
		if hang {
			<-ctx.Done()
			var zero R
			return zero, fmt.Errorf("%w: no reply: %w", sqllock.ErrUnavailable, ctx.Err())
		}
		return next(ctx)
	}
	times := func() []time.Time {
		mu.Lock()
		defer mu.Unlock()
		return append([]time.Time(nil), sent...)
	}
	return call, times
}

// A renewal that hangs is abandoned when it has had half of what its
// lease has left, and sent again at once, on another connection: one
// stuck connection, or three in a row, never cost the lease. Measured
// from outside before attempts were bounded: a Client whose pooled
// connections went half-open lost every lease renewed on them, while a
// renewal on a fresh connection would have succeeded.
func TestRenewalThatHangsIsRetried(t *testing.T) {
	t.Parallel()
	for _, hung := range []int{1, 3} {
		t.Run(fmt.Sprintf("hung=%d", hung), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				tb := setup(t, sqllock.Options{})
				renew, sent := hangFirst(hung, func(ctx context.Context) (sqllock.Lease, error) { return sqllock.Lease{}, nil })
				var mu sync.Mutex
				var lease sqllock.Lease
				var ttlArg time.Duration
				tb.b.renew = func(ctx context.Context, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
					mu.Lock()
					lease, ttlArg = l, ttl
					mu.Unlock()
					if _, err := renew(ctx); err != nil {
						return sqllock.Lease{}, err
					}
					mu.Lock()
					l, ttl = lease, ttlArg
					mu.Unlock()
					return tb.mem.TryRenew(ctx, l, ttl)
				}
				start := time.Now()
				g, err := tb.client.TryAcquire(t.Context(), "k", nil)
				require.NoError(t, err)
				local := g.LocalDeadline()
				time.Sleep(ttl + interval) // past the first local deadline
				require.NoError(t, g.Err(), "the lease was lost to hung renewals")
				times := sent()
				require.Greater(t, len(times), hung, "no renewal after the hung ones")
				// Each attempt was given half of what the lease had left,
				// and the next one sent at once.
				at := start.Add(interval)
				for i := range hung + 1 {
					require.Equal(t, at, times[i], "send time of attempt %d", i+1)
					at = at.Add(local.Sub(at) / 2)
				}
				require.True(t, times[hung].Before(local), "recovered before the local deadline")
				require.Greater(t, len(times), hung+1)
				// The next renewal is due one interval after the answered
				// attempt (it may go a renew window early, with the timer).
				require.False(t, times[hung+1].After(times[hung].Add(interval)), "the next renewal was late")
				require.Greater(t, times[hung+1].Sub(times[hung]), interval/2, "the next renewal came too soon")
				require.NoError(t, g.Release(t.Context()))
			})
		})
	}
}

// The same for a batch: 20 leases renewed together, their batch hanging
// (twice in a row), are all renewed by the attempt after it, none lost.
func TestBatchThatHangsIsRetried(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b, c := setupBatchy(t, sqllock.Options{})
		batch, sent := hangFirst(2, func(ctx context.Context) ([]sqllock.RenewResult, error) { return nil, nil })
		var reqs []sqllock.RenewRequest
		var mu sync.Mutex
		b.setBatch(func(ctx context.Context, r []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
			if _, err := batch(ctx); err != nil {
				return nil, err
			}
			mu.Lock()
			reqs = r
			mu.Unlock()
			return b.mem.TryRenewBatch(ctx, r)
		})
		keys := make([]string, 20)
		for i := range keys {
			keys[i] = fmt.Sprintf("k%02d", i)
		}
		start := time.Now()
		gs := acquireAll(t, c, keys...)
		local := gs[0].LocalDeadline()
		time.Sleep(ttl + interval)
		for _, g := range gs {
			require.NoError(t, g.Err(), "lease %s lost to a hung batch", g.Key())
		}
		times := sent()
		require.GreaterOrEqual(t, len(times), 3)
		first := start.Add(interval)
		require.Equal(t, first, times[0])
		second := first.Add(local.Sub(first) / 2)
		require.Equal(t, second, times[1], "the hung batch was abandoned at half of what its leases had left")
		require.Equal(t, second.Add(local.Sub(second)/2), times[2])
		mu.Lock()
		require.Len(t, reqs, len(keys), "every lease renewed in the batch after the hung ones")
		mu.Unlock()
		for _, g := range gs {
			require.NoError(t, g.Release(t.Context()))
		}
	})
}
