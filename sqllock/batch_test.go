package sqllock_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

// batchy is the memory backend with its batch renewal observable and
// replaceable; a nil batch passes through.
type batchy struct {
	sqllock.Backend
	mem *memory.Backend

	mu      sync.Mutex
	batch   func(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error)
	batches [][]string // the keys of each batch, in call order
	singles []string   // the keys of each TryRenew
}

// setBatch replaces the batch renewal (nil: the memory backend's).
func (b *batchy) setBatch(f func(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error)) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.batch = f
}

func (b *batchy) TryRenewBatch(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
	keys := make([]string, len(reqs))
	for i, r := range reqs {
		keys[i] = r.Lease.Key
	}
	b.mu.Lock()
	b.batches = append(b.batches, keys)
	f := b.batch
	b.mu.Unlock()
	if f != nil {
		return f(ctx, reqs)
	}
	return b.mem.TryRenewBatch(ctx, reqs)
}

func (b *batchy) TryRenew(ctx context.Context, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
	b.mu.Lock()
	b.singles = append(b.singles, l.Key)
	b.mu.Unlock()
	return b.mem.TryRenew(ctx, l, ttl)
}

func (b *batchy) calls() (batches [][]string, singles []string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([][]string(nil), b.batches...), append([]string(nil), b.singles...)
}

func setupBatchy(t *testing.T, opts sqllock.Options) (*batchy, *sqllock.Client) {
	t.Helper()
	mem := memory.New()
	b := &batchy{Backend: mem, mem: mem}
	opts.TTL = ttl
	opts.Owner = "test"
	if opts.Backoff == nil {
		opts.Backoff = func(int) time.Duration { return 100 * time.Millisecond }
	}
	c, err := sqllock.New(b, opts)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return b, c
}

func acquireAll(t *testing.T, c *sqllock.Client, keys ...string) []*sqllock.Guard {
	t.Helper()
	gs := make([]*sqllock.Guard, len(keys))
	for i, k := range keys {
		g, err := c.TryAcquire(t.Context(), k, nil)
		require.NoError(t, err)
		gs[i] = g
	}
	return gs
}

// G3 for batches: each guard's local deadline counts from the send time of
// the batch that renewed it, not from its reply, whatever the delays.
func TestBatchLocalDeadlineFromSendTime(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const reqDelay, replyDelay, margin = 300 * time.Millisecond, 400 * time.Millisecond, 50 * time.Millisecond
		b, c := setupBatchy(t, sqllock.Options{Margin: margin})
		b.setBatch(func(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
			time.Sleep(reqDelay)
			res, err := b.mem.TryRenewBatch(ctx, reqs)
			time.Sleep(replyDelay)
			return res, err
		})
		sent := time.Now()
		gs := acquireAll(t, c, "a", "b", "c")
		time.Sleep(time.Until(sent.Add(interval + reqDelay + replyDelay + time.Millisecond)))
		batches, singles := b.calls()
		require.Len(t, batches, 1, "one batch for the three leases due together")
		require.ElementsMatch(t, []string{"a", "b", "c"}, batches[0])
		require.Empty(t, singles)
		for _, g := range gs {
			require.NoError(t, g.Err())
			require.Equal(t, sent.Add(interval+ttl-margin), g.LocalDeadline(), "%s: counted from the batch's send time", g.Key())
		}
	})
}

// Leases due within the window are renewed together, and stay together:
// ten leases taken over 200ms cost one batch per interval, not ten calls.
func TestBatchGroupsLeasesDueWithinTheWindow(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b, c := setupBatchy(t, sqllock.Options{})
		for i := range 10 {
			acquireAll(t, c, fmt.Sprintf("k%d", i))
			time.Sleep(20 * time.Millisecond)
		}
		time.Sleep(10*interval + interval/2)
		batches, singles := b.calls()
		require.Empty(t, singles)
		require.Len(t, batches, 10, "one batch per interval")
		for _, keys := range batches {
			require.Len(t, keys, 10)
		}
		// A lease taken half an interval later is outside the window: it
		// is renewed on its own schedule.
		acquireAll(t, c, "late")
		time.Sleep(interval / 2)
		time.Sleep(interval)
		batches, _ = b.calls()
		require.Len(t, batches, 13)
		require.Equal(t, []string{"late"}, batches[11])
	})
}

// One batch, every outcome: the stolen lease ends its guard (taken), the
// released one is not renewed, and the others carry on.
func TestBatchMixedOutcomes(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b, c := setupBatchy(t, sqllock.Options{})
		gs := acquireAll(t, c, "a", "stolen", "c")
		b.mem.Expire("stolen")
		other, err := b.mem.TryAcquire(t.Context(), sqllock.AcquireRequest{Key: "stolen", TTL: ttl, Owner: "other"})
		require.NoError(t, err)
		time.Sleep(interval + time.Millisecond)
		batches, _ := b.calls()
		require.Len(t, batches, 1)
		require.ElementsMatch(t, []string{"a", "stolen", "c"}, batches[0])
		require.NoError(t, gs[0].Err())
		require.NoError(t, gs[2].Err())
		require.Equal(t, sqllock.LostTaken, lostReason(t, gs[1]))
		var le *sqllock.LostError
		require.ErrorAs(t, gs[1].Err(), &le)
		require.Equal(t, other.Token, le.Current)
		time.Sleep(3 * interval)
		require.NoError(t, gs[0].Err())
		require.NoError(t, gs[2].Err())
		batches, _ = b.calls()
		require.ElementsMatch(t, []string{"a", "c"}, batches[len(batches)-1], "the lost lease is renewed no more")
	})
}

// A batch that hangs past some of its guards' local deadlines: those end
// exactly at their deadlines (unreachable), and a guard whose deadline is
// later is renewed by the late reply, from the batch's send time.
func TestBatchHangingPastSomeDeadlines(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const margin = 50 * time.Millisecond
		b, c := setupBatchy(t, sqllock.Options{Margin: margin})
		start := time.Now()
		early := acquireAll(t, c, "early")[0]
		time.Sleep(200 * time.Millisecond) // within the window of 250ms
		late := acquireAll(t, c, "late")[0]
		var hang atomic.Bool
		hang.Store(true)
		b.setBatch(func(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
			if hang.Swap(false) {
				// Applied at once; the reply arrives after early's local
				// deadline, before late's.
				res, err := b.mem.TryRenewBatch(ctx, reqs)
				time.Sleep(time.Until(start.Add(ttl + 100*time.Millisecond)))
				return res, err
			}
			return b.mem.TryRenewBatch(ctx, reqs)
		})
		earlyDeadline := early.LocalDeadline()
		<-early.Done()
		require.Equal(t, earlyDeadline, time.Now(), "ended exactly at its local deadline")
		require.Equal(t, sqllock.LostUnreachable, lostReason(t, early))
		time.Sleep(time.Until(start.Add(ttl + 100*time.Millisecond + time.Millisecond)))
		require.NoError(t, late.Err(), "the guard whose deadline had not come is unaffected")
		batches, _ := b.calls()
		require.ElementsMatch(t, []string{"early", "late"}, batches[0])
		// The late reply renewed it, and as it was then already due (one
		// interval after the hung batch's send time) it was renewed again
		// at once, alone.
		require.Len(t, batches, 2)
		require.Equal(t, []string{"late"}, batches[1])
		require.Equal(t, start.Add(ttl+100*time.Millisecond+ttl-margin), late.LocalDeadline())
		require.NoError(t, late.Release(t.Context()))
		require.ErrorIs(t, early.Release(t.Context()), sqllock.ErrLeaseLost)
	})
}

// A batch whose reply is lost (applied, but the client cannot know): no
// lease in it is lost for that; each is retried, with its own backoff.
func TestBatchReplyLost(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b, c := setupBatchy(t, sqllock.Options{})
		var lose atomic.Int32
		lose.Store(2)
		b.setBatch(func(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
			_, err := b.mem.TryRenewBatch(ctx, reqs)
			require.NoError(t, err)
			if lose.Add(-1) >= 0 {
				return nil, fmt.Errorf("%w: reply lost", sqllock.ErrUnavailable)
			}
			return b.mem.TryRenewBatch(ctx, reqs)
		})
		start := time.Now()
		gs := acquireAll(t, c, "a", "b")
		time.Sleep(interval + 250*time.Millisecond)
		batches, _ := b.calls()
		require.Len(t, batches, 3, "the batch, then two retries 100ms apart")
		margin := ttl/100 + 2*time.Millisecond
		for _, g := range gs {
			require.NoError(t, g.Err())
			require.Equal(t, start.Add(interval+200*time.Millisecond+ttl-margin), g.LocalDeadline())
		}
	})
}

// An element that fails alone (its row was busy) is renewed at once on its
// own, with TryRenew; the others are renewed by the batch.
func TestBatchBusyElementRenewedAlone(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b, c := setupBatchy(t, sqllock.Options{})
		b.setBatch(func(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
			res, err := b.mem.TryRenewBatch(ctx, reqs[1:])
			if err != nil {
				return nil, err
			}
			busy := sqllock.RenewResult{Err: fmt.Errorf("%w: row locked", sqllock.ErrUnavailable)}
			return append([]sqllock.RenewResult{busy}, res...), nil
		})
		start := time.Now()
		gs := acquireAll(t, c, "busy", "b")
		time.Sleep(interval + time.Millisecond)
		_, singles := b.calls()
		require.Equal(t, []string{"busy"}, singles)
		margin := ttl/100 + 2*time.Millisecond
		for _, g := range gs {
			require.NoError(t, g.Err())
			require.Equal(t, start.Add(interval+ttl-margin), g.LocalDeadline())
		}
	})
}

// Release of one lease never cancels the batch in flight: the batch runs
// to its end and renews the others; the release waits for it, then
// releases, so it is the lease's last operation at the backend.
func TestReleaseDoesNotCancelTheBatchInFlight(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b, c := setupBatchy(t, sqllock.Options{})
		inFlight := make(chan struct{})
		var cancelled atomic.Bool
		var once sync.Once
		b.setBatch(func(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
			once.Do(func() { close(inFlight) })
			select {
			case <-time.After(200 * time.Millisecond):
			case <-ctx.Done():
				cancelled.Store(true)
				return nil, ctx.Err()
			}
			return b.mem.TryRenewBatch(ctx, reqs)
		})
		gs := acquireAll(t, c, "a", "b")
		<-inFlight
		start := time.Now()
		require.NoError(t, gs[0].Release(t.Context()))
		require.Equal(t, 200*time.Millisecond, time.Since(start), "the release waited for the batch")
		require.False(t, cancelled.Load(), "the release cancelled the batch")
		require.False(t, held(t, b.mem, "a"))
		require.NoError(t, gs[1].Err())
		require.True(t, held(t, b.mem, "b"))
		time.Sleep(2 * ttl)
		require.NoError(t, gs[1].Err(), "the other lease carries on")

		// Released while alone in a batch that does not answer: the
		// release waits half its bound, then gives up on the batch.
		b.setBatch(func(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
			<-ctx.Done()
			cancelled.Store(true)
			return nil, errors.Join(sqllock.ErrUnavailable, ctx.Err())
		})
		time.Sleep(interval)
		ctx, cancel := context.WithTimeout(t.Context(), 200*time.Millisecond)
		defer cancel()
		start = time.Now()
		require.NoError(t, gs[1].Release(ctx))
		require.Equal(t, 100*time.Millisecond, time.Since(start))
		require.True(t, cancelled.Load(), "a batch no live lease needs is cancelled")
		require.False(t, held(t, b.mem, "b"))
	})
}

// Releases racing batches: many guards released one by one while their
// batches are in flight; each release is the lease's last operation, no
// batch is cancelled, and nothing is left running (synctest's bubble ends
// empty).
func TestReleasesRacingBatches(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b, c := setupBatchy(t, sqllock.Options{})
		var cancelled atomic.Int32
		b.setBatch(func(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
			select {
			case <-time.After(50 * time.Millisecond):
			case <-ctx.Done():
				cancelled.Add(1)
				return nil, ctx.Err()
			}
			return b.mem.TryRenewBatch(ctx, reqs)
		})
		var keys []string
		for i := range 20 {
			keys = append(keys, fmt.Sprintf("k%02d", i))
		}
		gs := acquireAll(t, c, keys...)
		time.Sleep(interval + 10*time.Millisecond)
		var wg sync.WaitGroup
		for _, g := range gs {
			wg.Go(func() { require.NoError(t, g.Release(t.Context())) })
		}
		wg.Wait()
		require.Zero(t, cancelled.Load())
		for _, k := range keys {
			require.False(t, held(t, b.mem, k), k)
		}
	})
}

// Options.RenewWindow is the window: a lease due 350ms after another is
// renewed with it under a 400ms window (the default, a quarter of the
// interval, would leave it out), and one due 450ms after is not.
func TestBatchRenewWindowOption(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const window = 400 * time.Millisecond
		require.Less(t, interval/4, 350*time.Millisecond, "the default window would take in the second lease")
		b, c := setupBatchy(t, sqllock.Options{RenewWindow: window})
		acquireAll(t, c, "a")
		time.Sleep(350 * time.Millisecond)
		acquireAll(t, c, "within")
		time.Sleep(100 * time.Millisecond)
		acquireAll(t, c, "outside")
		time.Sleep(interval - 450*time.Millisecond + time.Millisecond)
		batches, singles := b.calls()
		require.Empty(t, singles)
		require.Equal(t, [][]string{{"a", "within"}}, batches, "the leases due within RenewWindow of the first")
		time.Sleep(450 * time.Millisecond)
		batches, _ = b.calls()
		require.Equal(t, [][]string{{"a", "within"}, {"outside"}}, batches)
	})
}

// Options.MaxRenewBatch bounds every batch: seven leases due together with
// a bound of three go as batches of three, three and one, never four.
func TestBatchMaxRenewBatch(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b, c := setupBatchy(t, sqllock.Options{MaxRenewBatch: 3})
		gs := acquireAll(t, c, "k0", "k1", "k2", "k3", "k4", "k5", "k6")
		time.Sleep(interval + time.Millisecond)
		synctest.Wait()
		batches, singles := b.calls()
		require.Empty(t, singles)
		var sizes []int
		var keys []string
		for _, ks := range batches {
			sizes = append(sizes, len(ks))
			keys = append(keys, ks...)
		}
		slices.Sort(sizes)
		require.Equal(t, []int{1, 3, 3}, sizes, "batches of at most MaxRenewBatch leases: %v", batches)
		require.ElementsMatch(t, []string{"k0", "k1", "k2", "k3", "k4", "k5", "k6"}, keys)
		for _, g := range gs {
			require.NoError(t, g.Err())
		}
	})
}
