package sqllock_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// faulty wraps a backend; a nil func field passes the call through. It
// hides the Watcher of the wrapped backend unless watch is set.
type faulty struct {
	sqllock.Backend
	acquire func(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error)
	renew   func(ctx context.Context, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error)
	release func(ctx context.Context, l sqllock.Lease) error

	mu     sync.Mutex
	calls  map[string]int
	renews []time.Time
}

func (f *faulty) count(op string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.calls == nil {
		f.calls = map[string]int{}
	}
	f.calls[op]++
	if op == "renew" {
		f.renews = append(f.renews, time.Now())
	}
}

func (f *faulty) renewTimes() []time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]time.Time(nil), f.renews...)
}

func (f *faulty) n(op string) int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls[op]
}

func (f *faulty) TryAcquire(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	f.count("acquire")
	if f.acquire != nil {
		return f.acquire(ctx, req)
	}
	return f.Backend.TryAcquire(ctx, req)
}

func (f *faulty) TryRenew(ctx context.Context, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
	f.count("renew")
	if f.renew != nil {
		return f.renew(ctx, l, ttl)
	}
	return f.Backend.TryRenew(ctx, l, ttl)
}

func (f *faulty) Release(ctx context.Context, l sqllock.Lease) error {
	f.count("release")
	if f.release != nil {
		return f.release(ctx, l)
	}
	return f.Backend.Release(ctx, l)
}

type testBundle struct {
	mem    *memory.Backend
	b      *faulty
	client *sqllock.Client
}

const (
	ttl      = 3 * time.Second
	interval = time.Second
)

func setup(t *testing.T, opts sqllock.Options) *testBundle {
	t.Helper()
	mem := memory.New()
	b := &faulty{Backend: mem}
	opts.TTL = ttl
	if opts.Owner == "" {
		opts.Owner = "test"
	}
	// No jitter: the simulated times below are exact.
	if opts.Backoff == nil {
		opts.Backoff = func(int) time.Duration { return 100 * time.Millisecond }
	}
	c, err := sqllock.New(b, opts)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return &testBundle{mem: mem, b: b, client: c}
}

func held(t *testing.T, mem *memory.Backend, key string) bool {
	t.Helper()
	infos, err := mem.List(context.Background(), key)
	require.NoError(t, err)
	return len(infos) == 1 && infos[0].Held
}

func lostReason(t *testing.T, g *sqllock.Guard) sqllock.LostReason {
	t.Helper()
	var le *sqllock.LostError
	require.ErrorAs(t, context.Cause(g.Context()), &le)
	require.ErrorIs(t, g.Err(), sqllock.ErrLeaseLost)
	return le.Reason
}

func TestRenewCadence(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		start := time.Now()
		g, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		time.Sleep(10*interval + interval/2)
		require.NoError(t, g.Err())
		renews := tb.b.renewTimes()
		require.Len(t, renews, 10)
		for i, at := range renews {
			require.Equal(t, time.Duration(i+1)*interval, at.Sub(start), "renew %d", i)
		}
		require.NoError(t, g.Release(t.Context()))
		require.False(t, held(t, tb.mem, "k"))
	})
}

func TestDefaultRenewIntervalIsTTLOverThree(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		g, err := tb.client.TryAcquire(t.Context(), "k", &sqllock.AcquireOptions{TTL: 9 * time.Second})
		require.NoError(t, err)
		time.Sleep(2*time.Second + 999*time.Millisecond)
		require.Equal(t, 0, tb.b.n("renew"))
		time.Sleep(time.Millisecond)
		synctest.Wait()
		require.Equal(t, 1, tb.b.n("renew"))
		require.NoError(t, g.Release(t.Context()))
	})
}

// TestLocalDeadlineFromSendTime checks G3's starting point: the local
// deadline counts from the moment the request was sent, never from the
// reply. Both the request and the reply are delayed (the backend has no say
// in the local deadline: Lease carries none), so a guard that counts from
// the reply is off by the round trip and fails here.
func TestLocalDeadlineFromSendTime(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const reqDelay, replyDelay = 300 * time.Millisecond, 400 * time.Millisecond
		const margin = 50 * time.Millisecond
		tb := setup(t, sqllock.Options{Margin: margin})
		// The request reaches the backend reqDelay after it was sent, and
		// the reply arrives replyDelay after the backend applied it.
		tb.b.acquire = func(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
			time.Sleep(reqDelay)
			l, err := tb.mem.TryAcquire(ctx, req)
			time.Sleep(replyDelay)
			return l, err
		}
		tb.b.renew = func(ctx context.Context, l sqllock.Lease, d time.Duration) (sqllock.Lease, error) {
			time.Sleep(reqDelay)
			nl, err := tb.mem.TryRenew(ctx, l, d)
			time.Sleep(replyDelay)
			return nl, err
		}
		sent := time.Now()
		g, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		require.Equal(t, sent.Add(ttl-margin), g.LocalDeadline(), "acquire: counted from the send time")

		// The first renewal is sent at sent+interval and answered
		// reqDelay+replyDelay later.
		time.Sleep(time.Until(sent.Add(interval + reqDelay + replyDelay + time.Millisecond)))
		require.NoError(t, g.Err())
		require.Equal(t, 1, tb.b.n("renew"))
		require.Equal(t, sent.Add(interval+ttl-margin), g.LocalDeadline(), "renew: counted from the send time")
		require.NoError(t, g.Release(t.Context()))
	})
}

func TestStolenLeaseLostWithinOneInterval(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		g, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		time.Sleep(interval / 2)
		tb.mem.Expire("k")
		other, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		stolen := time.Now()
		<-g.Done()
		require.LessOrEqual(t, time.Since(stolen), interval)
		require.Equal(t, sqllock.LostTaken, lostReason(t, g))
		require.Greater(t, other.Token(), g.Token())

		// Releasing the lost guard reports the loss and leaves the new
		// holder alone.
		require.ErrorIs(t, g.Release(t.Context()), sqllock.ErrLeaseLost)
		require.NoError(t, other.Err())
		require.True(t, held(t, tb.mem, "k"))
		require.NoError(t, other.Release(t.Context()))
	})
}

func TestLostAtLocalDeadlineWhenBackendHangs(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{Margin: 100 * time.Millisecond})
		var hang atomic.Bool
		tb.b.renew = func(ctx context.Context, l sqllock.Lease, d time.Duration) (sqllock.Lease, error) {
			if hang.Load() {
				<-ctx.Done() // no reply until the caller gives up
				return sqllock.Lease{}, errors.Join(sqllock.ErrUnavailable, ctx.Err())
			}
			return tb.mem.TryRenew(ctx, l, d)
		}
		g, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		time.Sleep(interval + time.Millisecond) // one good renewal
		require.NoError(t, g.Err())
		deadline := g.LocalDeadline()
		hang.Store(true)
		<-g.Done()
		require.Equal(t, deadline, time.Now(), "cancelled exactly at the local deadline")
		require.Equal(t, sqllock.LostUnreachable, lostReason(t, g))
		// The local deadline is before the backend's deadline.
		require.True(t, held(t, tb.mem, "k"))
		require.ErrorIs(t, g.Release(t.Context()), sqllock.ErrLeaseLost)
	})
}

func TestTransientRenewErrorsAreRetried(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		var failures atomic.Int32
		failures.Store(5) // 5 × 100ms of retries, well inside the lease
		tb.b.renew = func(ctx context.Context, l sqllock.Lease, d time.Duration) (sqllock.Lease, error) {
			if failures.Add(-1) >= 0 {
				return sqllock.Lease{}, sqllock.ErrUnavailable
			}
			return tb.mem.TryRenew(ctx, l, d)
		}
		start := time.Now()
		g, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		time.Sleep(interval + 600*time.Millisecond)
		require.NoError(t, g.Err(), "transient errors are not a loss")
		require.Equal(t, 6, tb.b.n("renew"))
		// The sixth attempt, sent at interval + 5×100ms, succeeded.
		margin := ttl/100 + 2*time.Millisecond
		require.Equal(t, start.Add(interval+500*time.Millisecond+ttl-margin), g.LocalDeadline())

		// Persistent failures: lost at the local deadline, with the error.
		failures.Store(1 << 30)
		deadline := g.LocalDeadline()
		<-g.Done()
		require.Equal(t, deadline, time.Now())
		require.Equal(t, sqllock.LostUnreachable, lostReason(t, g))
		require.ErrorIs(t, g.Err(), sqllock.ErrUnavailable)
		require.ErrorIs(t, g.Release(t.Context()), sqllock.ErrLeaseLost)
	})
}

func TestLateRenewalDoesNotRevive(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		var slow atomic.Bool
		tb.b.renew = func(ctx context.Context, l sqllock.Lease, d time.Duration) (sqllock.Lease, error) {
			if slow.Load() {
				// Ignores ctx, replies after the local deadline, success.
				time.Sleep(ttl)
				return tb.mem.TryRenew(context.Background(), l, d)
			}
			return tb.mem.TryRenew(ctx, l, d)
		}
		g, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		slow.Store(true)
		<-g.Done()
		require.Equal(t, sqllock.LostUnreachable, lostReason(t, g))
		time.Sleep(2 * ttl) // the slow renewal succeeds meanwhile
		require.Equal(t, sqllock.LostUnreachable, lostReason(t, g), "a late success must not revive")
		_, err = g.Renew(t.Context())
		require.ErrorIs(t, err, sqllock.ErrLeaseLost)
		require.ErrorIs(t, g.Release(t.Context()), sqllock.ErrLeaseLost)
	})
}

func TestReleaseRacingRenewal(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		inRenew := make(chan struct{})
		tb.b.renew = func(ctx context.Context, l sqllock.Lease, d time.Duration) (sqllock.Lease, error) {
			close(inRenew)
			select {
			case <-time.After(200 * time.Millisecond):
			case <-ctx.Done():
				return sqllock.Lease{}, ctx.Err()
			}
			return tb.mem.TryRenew(ctx, l, d)
		}
		g, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		<-inRenew
		require.NoError(t, g.Release(t.Context()))
		require.ErrorIs(t, context.Cause(g.Context()), sqllock.ErrReleased)
		require.ErrorIs(t, g.Err(), sqllock.ErrReleased)
		require.False(t, held(t, tb.mem, "k"))
		require.NoError(t, g.Release(t.Context()), "a second Release returns the first result")
		_, err = g.Renew(t.Context())
		require.ErrorIs(t, err, sqllock.ErrReleased)
		time.Sleep(2 * ttl)
		require.Equal(t, 1, tb.b.n("renew"), "no renewal after Release")
		require.Equal(t, 1, tb.b.n("release"))
	})
}

func TestConcurrentReleases(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		g, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() { require.NoError(t, g.Release(context.Background())) })
		}
		wg.Wait()
		require.Equal(t, 1, tb.b.n("release"))
	})
}

// TestReleaseWaitsForTheFirstRelease: a Release made while another is at
// the backend waits for it and returns its result; one whose context ends
// first returns that context's error, and the lease is released once.
func TestReleaseWaitsForTheFirstRelease(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		refused := errors.New("release refused")
		unblock := make(chan struct{})
		tb.b.release = func(ctx context.Context, l sqllock.Lease) error {
			<-unblock
			return refused
		}
		g, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		errs := make(chan error, 2)
		go func() { errs <- g.Release(t.Context()) }()
		synctest.Wait() // the first Release is at the backend
		go func() { errs <- g.Release(t.Context()) }()
		short, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		require.ErrorIs(t, g.Release(short), context.DeadlineExceeded, "a Release whose context ends first")
		synctest.Wait()
		require.Empty(t, errs, "no Release returns before the first one's result")
		close(unblock)
		require.ErrorIs(t, <-errs, refused)
		require.ErrorIs(t, <-errs, refused, "the waiting Release returns the first one's result")
		require.ErrorIs(t, g.Release(t.Context()), refused, "a later Release returns it too")
		require.Equal(t, 1, tb.b.n("release"))
	})
}

func TestParentContextCancelled(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		ctx, cancel := context.WithCancel(t.Context())
		g, err := tb.client.TryAcquire(ctx, "k", nil)
		require.NoError(t, err)
		cancel()
		<-g.Done()
		require.ErrorIs(t, context.Cause(g.Context()), context.Canceled)
		synctest.Wait()
		require.False(t, held(t, tb.mem, "k"), "released on the caller's behalf")
		require.NoError(t, g.Release(t.Context()))
		require.Equal(t, 1, tb.b.n("release"))
	})
}

// Guards acquired under one context share one watch on it: its end ends
// each of them and releases each lease, and a Guard released or lost
// before it is not touched.
func TestParentContextSharedByGuards(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		ctx, cancel := context.WithCancel(t.Context())
		var gs []*sqllock.Guard
		for _, k := range []string{"a", "b", "c", "released", "lost"} {
			g, err := tb.client.TryAcquire(ctx, k, nil)
			require.NoError(t, err)
			gs = append(gs, g)
		}
		n, idle := sqllock.Watches(tb.client)
		require.Equal(t, 1, n, "one watch for one context")
		require.False(t, idle)
		require.NoError(t, gs[3].Release(t.Context()))
		tb.mem.Expire("lost")
		time.Sleep(ttl / 2) // the renewal finds the loss
		require.ErrorIs(t, gs[4].Err(), sqllock.ErrLeaseLost)
		releases := tb.b.n("release")

		cancel()
		synctest.Wait()
		for _, g := range gs[:3] {
			require.ErrorIs(t, g.Err(), context.Canceled)
			require.False(t, held(t, tb.mem, g.Key()), "released on the caller's behalf")
		}
		require.Equal(t, releases+3, tb.b.n("release"), "the released and the lost Guards were not released again")
		require.ErrorIs(t, gs[3].Err(), sqllock.ErrReleased)
		require.ErrorIs(t, gs[4].Err(), sqllock.ErrLeaseLost)
		n, _ = sqllock.Watches(tb.client)
		require.Zero(t, n, "an ended context is not watched")
	})
}

// A loop of acquire and release under one context reuses its watch (the
// idle one); the Client keeps at most one idle watch, so contexts that
// never end are not kept one per acquire; Close stops every watch.
func TestParentWatchesBounded(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		ctx, cancel := context.WithCancel(t.Context())
		for range 3 {
			g, err := tb.client.TryAcquire(ctx, "k", nil)
			require.NoError(t, err)
			require.NoError(t, g.Release(ctx))
			n, idle := sqllock.Watches(tb.client)
			require.Equal(t, 1, n)
			require.True(t, idle)
		}
		// The idle watch still works for the next Guard.
		g, err := tb.client.TryAcquire(ctx, "k", nil)
		require.NoError(t, err)
		cancel()
		synctest.Wait()
		require.ErrorIs(t, g.Err(), context.Canceled)
		require.False(t, held(t, tb.mem, "k"))

		// Contexts that do not end while the Client runs (as one whose
		// cancel is never called).
		for i := range 10 {
			never, cancel := context.WithCancel(t.Context())
			defer cancel()
			g, err := tb.client.TryAcquire(never, fmt.Sprint("k", i), nil)
			require.NoError(t, err)
			require.NoError(t, g.Release(never))
		}
		n, idle := sqllock.Watches(tb.client)
		require.Equal(t, 1, n, "idle watches kept for contexts that never end")
		require.True(t, idle)
		require.NoError(t, tb.client.Close(t.Context()))
		n, _ = sqllock.Watches(tb.client)
		require.Zero(t, n, "Close left a watch")
	})
}

func TestDoCancelsOnLoss(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		err := tb.client.Do(t.Context(), "k", nil, func(ctx context.Context, g *sqllock.Guard) error {
			tb.mem.Expire("k")
			_, err := tb.client.TryAcquire(t.Context(), "k", nil)
			require.NoError(t, err)
			<-ctx.Done()
			var le *sqllock.LostError
			require.ErrorAs(t, context.Cause(ctx), &le)
			require.Equal(t, sqllock.LostTaken, le.Reason)
			return nil
		})
		require.ErrorIs(t, err, sqllock.ErrLeaseLost)
	})
}

func TestDoReleasesAndReturnsFnError(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		boom := errors.New("boom")
		err := tb.client.Do(t.Context(), "k", nil, func(ctx context.Context, g *sqllock.Guard) error {
			require.True(t, held(t, tb.mem, "k"))
			return boom
		})
		require.ErrorIs(t, err, boom)
		require.NotErrorIs(t, err, sqllock.ErrLeaseLost)
		require.False(t, held(t, tb.mem, "k"))

		require.Panics(t, func() {
			_ = tb.client.Do(t.Context(), "k", nil, func(context.Context, *sqllock.Guard) error { panic("fn") })
		})
		require.False(t, held(t, tb.mem, "k"), "released after a panic")
	})
}

// A forced release (another owner releasing the lease's token) between two
// renewals: fn ends before the next renewal would notice, and Do reports
// the loss from the release instead of success.
func TestDoReportsForcedReleaseBeforeNextRenewal(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		var lease sqllock.Lease
		err := tb.client.Do(t.Context(), "k", nil, func(ctx context.Context, g *sqllock.Guard) error {
			lease = g.Lease()
			forced := sqllock.Lease{Key: lease.Key, Token: lease.Token, Owner: "operator"}
			require.NoError(t, tb.mem.Release(ctx, forced))
			time.Sleep(interval / 2) // work on, the next renewal still ahead
			require.NoError(t, g.Err(), "no renewal since the forced release")
			return nil
		})
		var le *sqllock.LostError
		require.ErrorAs(t, err, &le)
		require.Equal(t, sqllock.LostReleased, le.Reason)
		require.Equal(t, "operator", le.By)
		require.Equal(t, lease.Token, le.Token)
		require.Zero(t, tb.b.n("renew"))
	})
}

// docs/pitfalls.md#18 (ShedLock#317): two Clients given the same owner name (the
// host name, say; two processes on one host) must not be taken for a
// retry of each other's acquire and handed one lease.
func TestClientsSharingAnOwnerNameExcludeEachOther(t *testing.T) {
	t.Parallel()
	ctx := t.Context()
	mem := memory.New()
	a, err := sqllock.New(mem, sqllock.Options{Owner: "web01"})
	require.NoError(t, err)
	defer a.Close(ctx)
	b, err := sqllock.New(mem, sqllock.Options{Owner: "web01"})
	require.NoError(t, err)
	defer b.Close(ctx)

	ga, err := a.TryAcquire(ctx, "k", nil)
	require.NoError(t, err)
	_, err = b.TryAcquire(ctx, "k", nil)
	require.ErrorIs(t, err, sqllock.ErrNotAcquired, "a second client with the same owner name got the held lease")
	require.NotEqual(t, ga.Lease().Owner, "web01/1")
	require.True(t, strings.HasPrefix(ga.Lease().Owner, "web01/"), ga.Lease().Owner)
	require.NoError(t, ga.Release(ctx))

	// Owner names may use all but ownerSuffixLen bytes.
	_, err = sqllock.New(mem, sqllock.Options{Owner: strings.Repeat("o", sqllock.MaxOwnerLen-34)})
	require.NoError(t, err)
	_, err = sqllock.New(mem, sqllock.Options{Owner: strings.Repeat("o", sqllock.MaxOwnerLen-33)})
	require.ErrorIs(t, err, sqllock.ErrInvalidOwner)
	long, err := sqllock.New(mem, sqllock.Options{Owner: strings.Repeat("o", sqllock.MaxOwnerLen-34)})
	require.NoError(t, err)
	g, err := long.TryAcquire(ctx, "long", nil)
	require.NoError(t, err, "the longest owner name plus its suffix must be a valid lease owner")
	require.LessOrEqual(t, len(g.Lease().Owner), sqllock.MaxOwnerLen)
	require.NoError(t, long.Close(ctx))
}

func TestAcquireWakesOnRelease(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{Backoff: func(int) time.Duration { return time.Hour }})
		// With a Watcher, a waiter wakes at the release, not at its poll.
		c, err := sqllock.New(tb.mem, sqllock.Options{TTL: ttl, Backoff: func(int) time.Duration { return time.Hour }})
		require.NoError(t, err)
		defer c.Close(t.Context())
		holder, err := c.TryAcquire(t.Context(), "k", &sqllock.AcquireOptions{TTL: time.Hour})
		require.NoError(t, err)
		go func() {
			time.Sleep(5 * time.Second)
			require.NoError(t, holder.Release(context.Background()))
		}()
		start := time.Now()
		g, err := c.Acquire(t.Context(), "k", &sqllock.AcquireOptions{Wait: sqllock.WaitForever})
		require.NoError(t, err)
		require.Equal(t, 5*time.Second, time.Since(start))
		require.Greater(t, g.Token(), holder.Token())
		require.NoError(t, g.Release(t.Context()))
		_ = tb
	})
}

func TestAcquireWaitIsCappedByRemainingLease(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		// No Watcher (faulty hides it) and a huge backoff: the waiter must
		// still wake when the crashed holder's lease ends.
		tb := setup(t, sqllock.Options{Backoff: func(int) time.Duration { return time.Hour }})
		crashed, err := tb.mem.TryAcquire(t.Context(), sqllock.AcquireRequest{Key: "k", TTL: 7 * time.Second, Owner: "crashed"})
		require.NoError(t, err)
		start := time.Now()
		g, err := tb.client.Acquire(t.Context(), "k", &sqllock.AcquireOptions{Wait: sqllock.WaitForever})
		require.NoError(t, err)
		require.Equal(t, 7*time.Second, time.Since(start))
		require.Greater(t, g.Token(), crashed.Token)
		require.Equal(t, 2, tb.b.n("acquire"))
		require.NoError(t, g.Release(t.Context()))
	})
}

func TestAcquireWaitBound(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		holder, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		start := time.Now()
		// The holder renews forever, so an Acquire that ignored Wait
		// would never return: the backstop ends it (in bubble time, at
		// once) and the elapsed time below tells the two apart, instead
		// of the test hanging until go test's timeout.
		backstop, stop := context.WithTimeout(t.Context(), time.Minute)
		defer stop()
		_, err = tb.client.Acquire(backstop, "k", &sqllock.AcquireOptions{Wait: 2 * time.Second})
		require.Equal(t, 2*time.Second, time.Since(start), "Acquire must give up when Wait passes")
		require.ErrorIs(t, err, sqllock.ErrNotAcquired)
		require.ErrorIs(t, err, context.DeadlineExceeded)

		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		_, err = tb.client.Acquire(ctx, "k", &sqllock.AcquireOptions{Wait: sqllock.WaitForever})
		require.ErrorIs(t, err, sqllock.ErrNotAcquired)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.NoError(t, holder.Release(t.Context()))
	})
}

func TestWaitDoesNotEndTheGuard(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		g, err := tb.client.Acquire(t.Context(), "k", &sqllock.AcquireOptions{Wait: time.Second})
		require.NoError(t, err)
		time.Sleep(10 * time.Second)
		require.NoError(t, g.Err())
		require.NoError(t, g.Release(t.Context()))
	})
}

func TestIndeterminateAcquireIsSettled(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		var first atomic.Bool
		first.Store(true)
		tb.b.acquire = func(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
			l, err := tb.mem.TryAcquire(ctx, req)
			if first.Swap(false) {
				return sqllock.Lease{}, sqllock.ErrIndeterminate // applied, reply lost
			}
			return l, err
		}
		g, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		require.Equal(t, int64(1), g.Token(), "the retry got the same grant, not a second tenure")
		require.Equal(t, 2, tb.b.n("acquire"))
		require.NoError(t, g.Release(t.Context()))
	})
}

func TestIndeterminateAcquireAfterContextEndIsReleased(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		ctx, cancel := context.WithCancel(t.Context())
		tb.b.acquire = func(actx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
			if actx == ctx {
				l, err := tb.mem.TryAcquire(actx, req)
				require.NoError(t, err)
				cancel() // the context ends while the reply is in flight
				return l, errors.Join(sqllock.ErrIndeterminate, context.Canceled)
			}
			return tb.mem.TryAcquire(actx, req)
		}
		_, err := tb.client.TryAcquire(ctx, "k", nil)
		require.ErrorIs(t, err, context.Canceled)
		require.False(t, held(t, tb.mem, "k"), "the settled grant was released")
	})
}

func TestIndeterminateAcquireWhenTheWaitEnds(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		var first atomic.Bool
		first.Store(true)
		tb.b.acquire = func(actx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
			if actx.Err() != nil {
				return sqllock.Lease{}, actx.Err() // not sent
			}
			if first.Swap(false) {
				// Applied, but the reply is lost when the wait ends.
				_, err := tb.mem.TryAcquire(actx, req)
				require.NoError(t, err)
				<-actx.Done()
				return sqllock.Lease{}, errors.Join(sqllock.ErrIndeterminate, actx.Err())
			}
			return tb.mem.TryAcquire(actx, req)
		}
		_, err := tb.client.Acquire(t.Context(), "k", &sqllock.AcquireOptions{Wait: time.Second})
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.False(t, held(t, tb.mem, "k"), "the grant applied before the wait ended was settled and released")
	})
}

// A wait that ends under an attempt that cannot have taken the key (etcd's
// lease grant, a read: unavailable, not indeterminate, cut by the wait's
// deadline) ends as the wait's end, with the holder the attempts before it
// found, not as the backend being unavailable: sqllock run --wait exits
// 75 then, not 69 (seen on etcd, where a grant's etcd lease may be
// granted first).
func TestWaitEndsUnderAnAttemptThatTookNothing(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		holder, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		var n atomic.Int32
		tb.b.acquire = func(actx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
			if n.Add(1) == 2 {
				<-actx.Done() // the second attempt is in flight when the wait ends
				return sqllock.Lease{}, fmt.Errorf("lease grant %q: %w: the context ended while the request was in flight: %w", req.Key, sqllock.ErrUnavailable, actx.Err())
			}
			return tb.mem.TryAcquire(actx, req)
		}
		// Backoff 0 and no Watcher beside it: the second attempt starts at
		// once and hangs until the wait ends.
		_, err = tb.client.Acquire(t.Context(), "k", &sqllock.AcquireOptions{Wait: time.Second})
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.ErrorIs(t, err, sqllock.ErrNotAcquired, "%v", err)
		var he *sqllock.HeldError
		require.ErrorAs(t, err, &he)
		require.NotErrorIs(t, err, sqllock.ErrUnavailable, "%v", err)
		require.NoError(t, holder.Release(t.Context()))
	})
}

// An acquire attempt that hangs (a dead connection, a stalled database)
// does not stall Acquire until its context ends: each attempt is bounded
// by the TTL less the margin, after which its grant could not be used
// anyway, and the next attempt, by the same owner, settles it. Found by
// the election simulation (TestElectionSim), where a candidate whose
// attempt hung (a hang fault, or a pause) never campaigned again.
func TestAcquireAttemptThatHangsIsRetried(t *testing.T) {
	t.Parallel()
	for _, applied := range []bool{false, true} {
		t.Run(fmt.Sprintf("applied=%v", applied), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				tb := setup(t, sqllock.Options{})
				var first atomic.Bool
				first.Store(true)
				tb.b.acquire = func(actx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
					if first.Swap(false) {
						if applied {
							_, err := tb.mem.TryAcquire(actx, req)
							require.NoError(t, err)
						}
						<-actx.Done() // hangs until its context ends
						return sqllock.Lease{}, actx.Err()
					}
					return tb.mem.TryAcquire(actx, req)
				}
				start := time.Now()
				g, err := tb.client.Acquire(t.Context(), "k", &sqllock.AcquireOptions{Wait: sqllock.WaitForever})
				require.NoError(t, err)
				margin := ttl/100 + 2*time.Millisecond // the default
				require.Equal(t, ttl-margin+100*time.Millisecond, time.Since(start), "the hung attempt was cut at TTL - margin, then one backoff")
				// An applied attempt's grant expired unused before the retry:
				// the retry is a new tenure, after it.
				require.Equal(t, map[bool]int64{false: 1, true: 2}[applied], g.Token())
				require.Equal(t, 2, tb.b.n("acquire"))
				require.NoError(t, g.Release(t.Context()))
			})
		})
	}
}

func TestIndeterminateUnsettled(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		tb.b.acquire = func(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
			return sqllock.Lease{}, sqllock.ErrIndeterminate
		}
		_, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.ErrorIs(t, err, sqllock.ErrIndeterminate)
	})
}

func TestBadInputBeforeIO(t *testing.T) {
	t.Parallel()
	tb := setup(t, sqllock.Options{})
	for _, key := range []string{"", "a\x00", "\xff"} {
		_, err := tb.client.TryAcquire(t.Context(), key, nil)
		require.ErrorIs(t, err, sqllock.ErrInvalidKey)
		_, err = tb.client.Acquire(t.Context(), key, nil)
		require.ErrorIs(t, err, sqllock.ErrInvalidKey)
		err = tb.client.Do(t.Context(), key, nil, func(context.Context, *sqllock.Guard) error { return nil })
		require.ErrorIs(t, err, sqllock.ErrInvalidKey)
	}
	for _, ao := range []*sqllock.AcquireOptions{{TTL: time.Microsecond}, {TTL: 48 * time.Hour}, {TTL: -1}, {Wait: -1}} {
		_, err := tb.client.TryAcquire(t.Context(), "k", ao)
		require.ErrorIs(t, err, sqllock.ErrInvalidTTL)
	}
	require.Equal(t, 0, tb.b.n("acquire"))
}

func TestNewValidatesOptions(t *testing.T) {
	t.Parallel()
	mem := memory.New()
	for _, o := range []sqllock.Options{
		{TTL: time.Microsecond},
		{TTL: 10 * time.Second, RenewInterval: 6 * time.Second},
		{TTL: 10 * time.Second, Margin: 5 * time.Second},
		{TTL: 10 * time.Second, Margin: -1},
		{TTL: 10 * time.Second, ReleaseTimeout: -1},
	} {
		_, err := sqllock.New(mem, o)
		require.ErrorIs(t, err, sqllock.ErrInvalidTTL, "%+v", o)
	}
	for _, owner := range []string{"a\x00", "\xff", string(make([]byte, 500))} {
		_, err := sqllock.New(mem, sqllock.Options{Owner: owner})
		require.ErrorIs(t, err, sqllock.ErrInvalidOwner)
	}
	_, err := sqllock.New(nil, sqllock.Options{})
	require.Error(t, err)
	c, err := sqllock.New(mem, sqllock.Options{})
	require.NoError(t, err)
	require.NotEmpty(t, c.Owner())
}

// TestNewRefusesTinyIntervals: a RenewInterval or Margin meant as seconds
// but given as a bare number (5 is 5ns) is refused before any I/O, with the
// bound in the error; a watchdog renewing every few nanoseconds floods the
// database.
func TestNewRefusesTinyIntervals(t *testing.T) {
	t.Parallel()
	mem := memory.New()
	for _, tc := range []struct {
		o     sqllock.Options
		field string
	}{
		{sqllock.Options{RenewInterval: 5}, "RenewInterval"},
		{sqllock.Options{RenewInterval: time.Millisecond - 1}, "RenewInterval"},
		{sqllock.Options{Margin: 5}, "Margin"},
		{sqllock.Options{Margin: 999 * time.Microsecond}, "Margin"},
	} {
		_, err := sqllock.New(mem, tc.o)
		require.ErrorIs(t, err, sqllock.ErrInvalidOption, "%+v", tc.o)
		require.ErrorIs(t, err, sqllock.ErrInvalidTTL, "%+v", tc.o) // as documented for New
		var oe *sqllock.OptionError
		require.ErrorAs(t, err, &oe)
		require.Equal(t, tc.field, oe.Field)
		require.Equal(t, sqllock.MinInterval, oe.Min)
		require.Contains(t, err.Error(), "at least 1ms")
	}
	for _, o := range []sqllock.Options{
		{RenewInterval: time.Millisecond, TTL: time.Second},
		{Margin: time.Millisecond},
	} {
		_, err := sqllock.New(mem, o)
		require.NoError(t, err, "%+v", o)
	}
}

func TestOwnerUniquePerAcquireCall(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		g1, err := tb.client.TryAcquire(t.Context(), "a", nil)
		require.NoError(t, err)
		g2, err := tb.client.TryAcquire(t.Context(), "b", nil)
		require.NoError(t, err)
		require.NotEqual(t, g1.Lease().Owner, g2.Lease().Owner)
		// Two calls of one client contend like strangers.
		_, err = tb.client.TryAcquire(t.Context(), "a", nil)
		require.ErrorIs(t, err, sqllock.ErrNotAcquired)
	})
}

func TestCloseReleasesGuards(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		g, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		require.NoError(t, tb.client.Close(t.Context()))
		require.ErrorIs(t, g.Err(), sqllock.ErrReleased)
		require.False(t, held(t, tb.mem, "k"))
		_, err = tb.client.TryAcquire(t.Context(), "k", nil)
		require.ErrorIs(t, err, sqllock.ErrClosed)
		require.NoError(t, tb.client.Close(t.Context()))
	})
}

// The renewal scheduler's timer is left set when the last Guard goes (an
// acquire-release pair does not stop and set it again): it fires once for
// nothing, and Close stops it, so that nothing of a closed Client stays
// armed.
func TestSchedulerTimerWhenIdle(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		for _, k := range []string{"a", "b"} {
			g, err := tb.client.TryAcquire(t.Context(), k, nil)
			require.NoError(t, err)
			require.NoError(t, g.Release(t.Context()))
			require.True(t, sqllock.SchedulerArmed(tb.client), "left set with no Guard")
		}
		time.Sleep(ttl) // it fires, for nothing
		synctest.Wait()
		require.False(t, sqllock.SchedulerArmed(tb.client), "set again with no Guard")
		require.Zero(t, tb.b.n("renew"))

		g, err := tb.client.TryAcquire(t.Context(), "a", nil)
		require.NoError(t, err)
		require.NoError(t, g.Release(t.Context()))
		require.True(t, sqllock.SchedulerArmed(tb.client))
		require.NoError(t, tb.client.Close(t.Context()))
		require.False(t, sqllock.SchedulerArmed(tb.client), "Close left the timer set")
	})
}

func TestCloseWakesWaiters(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{Backoff: func(int) time.Duration { return time.Hour }})
		_, err := tb.mem.TryAcquire(t.Context(), sqllock.AcquireRequest{Key: "k", TTL: time.Hour, Owner: "other"})
		require.NoError(t, err)
		errc := make(chan error)
		go func() {
			_, err := tb.client.Acquire(t.Context(), "k", &sqllock.AcquireOptions{Wait: sqllock.WaitForever})
			errc <- err
		}()
		time.Sleep(time.Second)
		require.NoError(t, tb.client.Close(t.Context()))
		require.ErrorIs(t, <-errc, sqllock.ErrClosed)
	})
}

func TestManualRenew(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		g, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		time.Sleep(interval / 2)
		before := g.LocalDeadline()
		l, err := g.Renew(t.Context())
		require.NoError(t, err)
		require.Equal(t, g.Token(), l.Token)
		require.Equal(t, before.Add(interval/2), g.LocalDeadline())
		tb.mem.Expire("k")
		_, err = g.Renew(t.Context())
		require.ErrorIs(t, err, sqllock.ErrLeaseLost)
		<-g.Done()
		require.Equal(t, sqllock.LostExpired, lostReason(t, g))
	})
}

// docs/pitfalls.md#16 (pglock#5): a Release called with a context that has already
// ended (the request's, after a timeout) must still reach the backend.
func TestReleaseWithEndedContextStillReleases(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		var sentWith error
		tb.b.release = func(ctx context.Context, l sqllock.Lease) error {
			sentWith = ctx.Err()
			return tb.mem.Release(ctx, l)
		}
		g, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		ended, cancel := context.WithCancel(t.Context())
		cancel()
		require.NoError(t, g.Release(ended))
		require.NoError(t, sentWith, "the backend got an ended context")
		require.Equal(t, 1, tb.b.n("release"))
		require.False(t, held(t, tb.mem, "k"))
	})
}

// WD-6: a release whose reply is lost. The guard ends at once either way;
// the release is repeated (harmless: the backend tells a repeat by the
// same owner), and when every reply is lost Release says the outcome is
// unknown, and says it again without another call.
func TestReleaseReplyLost(t *testing.T) {
	t.Parallel()
	lostReply := func(tb *testBundle, times int) {
		tb.b.release = func(ctx context.Context, l sqllock.Lease) error {
			if err := tb.mem.Release(ctx, l); err != nil {
				return err
			}
			if tb.b.n("release") <= times {
				return fmt.Errorf("%w: reply lost", sqllock.ErrIndeterminate)
			}
			return nil
		}
	}
	t.Run("Once", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			tb := setup(t, sqllock.Options{})
			lostReply(tb, 1)
			g, err := tb.client.TryAcquire(t.Context(), "k", nil)
			require.NoError(t, err)
			require.NoError(t, g.Release(t.Context()))
			require.Equal(t, 2, tb.b.n("release"))
			require.ErrorIs(t, g.Err(), sqllock.ErrReleased)
			require.False(t, held(t, tb.mem, "k"))
		})
	})
	t.Run("Always", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			tb := setup(t, sqllock.Options{})
			lostReply(tb, 1000)
			g, err := tb.client.TryAcquire(t.Context(), "k", nil)
			require.NoError(t, err)
			err = g.Release(t.Context())
			require.ErrorIs(t, err, sqllock.ErrIndeterminate)
			require.ErrorIs(t, g.Err(), sqllock.ErrReleased, "the guard must end even when the release is unknown")
			calls := tb.b.n("release")
			require.Equal(t, 3, calls)
			require.Equal(t, err, g.Release(t.Context()), "a second Release repeats the answer")
			require.Equal(t, calls, tb.b.n("release"), "a second Release sent again")
			require.False(t, held(t, tb.mem, "k"), "applied, only the reply was lost")
		})
	})
}

// WD-8: the client does no arithmetic between the database's clock and its
// own: a database clock an hour ahead of or behind the local one changes
// neither the local deadline nor the renewal cadence.
func TestDatabaseClockOffsetIsIgnored(t *testing.T) {
	t.Parallel()
	for _, offset := range []time.Duration{time.Hour, -time.Hour} {
		t.Run(offset.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				mem := memory.NewWithClock(func() time.Time { return time.Now().Add(offset) })
				fb := &faulty{Backend: mem}
				c, err := sqllock.New(fb, sqllock.Options{TTL: ttl, Margin: 50 * time.Millisecond})
				require.NoError(t, err)
				defer c.Close(context.Background())
				sent := time.Now()
				g, err := c.TryAcquire(t.Context(), "k", nil)
				require.NoError(t, err)
				require.Equal(t, sent.Add(ttl-50*time.Millisecond), g.LocalDeadline())
				require.WithinDuration(t, sent.Add(offset), g.Lease().BackendTime, time.Millisecond)
				time.Sleep(5*interval + interval/2)
				require.NoError(t, g.Err())
				renews := fb.renewTimes()
				require.Len(t, renews, 5)
				for i, at := range renews {
					require.Equal(t, sent.Add(time.Duration(i+1)*interval), at)
				}
				require.Equal(t, renews[4].Add(ttl-50*time.Millisecond), g.LocalDeadline())
				require.NoError(t, g.Release(t.Context()))
			})
		})
	}
}

// The README's scheduled job: three replicas (three Clients on one
// backend) call Do with nil options at once; the job runs once and the
// other two get ErrNotAcquired without running it.
func TestDoWithoutWaitRunsOnce(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		mem := memory.New()
		var (
			runs, skips atomic.Int32
			wg          sync.WaitGroup
		)
		for i := range 3 {
			c, err := sqllock.New(mem, sqllock.Options{Owner: fmt.Sprint("replica-", i)})
			require.NoError(t, err)
			defer c.Close(context.Background())
			wg.Go(func() {
				err := c.Do(t.Context(), "nightly-report", nil, func(ctx context.Context, g *sqllock.Guard) error {
					runs.Add(1)
					time.Sleep(time.Second) // the job
					return nil
				})
				if errors.Is(err, sqllock.ErrNotAcquired) {
					skips.Add(1)
					return
				}
				require.NoError(t, err)
			})
		}
		wg.Wait()
		require.Equal(t, int32(1), runs.Load(), "runs of the job")
		require.Equal(t, int32(2), skips.Load(), "replicas that skipped it")
	})
}

// Acquire without a Wait is one attempt: it returns at once with the
// holder's HeldError; WaitForever waits until the context ends.
func TestAcquireWithoutWaitIsOneAttempt(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		holder, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		before := tb.b.n("acquire")
		start := time.Now()
		// The holder renews forever: an Acquire that waited would never
		// return, so a backstop ends it and the elapsed time tells.
		backstop, stop := context.WithTimeout(t.Context(), time.Minute)
		defer stop()
		for _, ao := range []*sqllock.AcquireOptions{nil, {}, {TTL: time.Minute}} {
			_, err = tb.client.Acquire(backstop, "k", ao)
			var he *sqllock.HeldError
			require.ErrorAs(t, err, &he)
			require.NotErrorIs(t, err, context.DeadlineExceeded)
		}
		require.Zero(t, time.Since(start), "no wait")
		require.Equal(t, 3, tb.b.n("acquire")-before, "one attempt each")
		start = time.Now()

		ctx, cancel := context.WithTimeout(t.Context(), time.Hour)
		defer cancel()
		_, err = tb.client.Acquire(ctx, "k", &sqllock.AcquireOptions{Wait: sqllock.WaitForever})
		require.Equal(t, time.Hour, time.Since(start), "WaitForever waits until the context ends")
		require.ErrorIs(t, err, sqllock.ErrNotAcquired)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.NoError(t, holder.Release(t.Context()))
	})
}

// A Close that comes while an acquire hands its Guard out (linked to the
// Client, not yet scheduled) releases it; the scheduler must not be armed
// again after Close, nor renew the released lease. Not parallel: it sets
// a package-wide hook.
func TestCloseDuringHoldLeavesNothingScheduled(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		sqllock.SetAfterHold(t, func(c *sqllock.Client) {
			if c == tb.client {
				require.NoError(t, c.Close(t.Context()))
			}
		})
		g, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		require.ErrorIs(t, g.Err(), sqllock.ErrReleased)
		require.False(t, held(t, tb.mem, "k"), "Close released it")
		require.False(t, sqllock.SchedulerArmed(tb.client), "the scheduler was armed after Close")
		time.Sleep(2 * ttl)
		require.Equal(t, 0, tb.b.n("renew"), "a released lease was renewed after Close")
	})
}

// An indeterminate acquire whose repeat a context cuts short (not sent,
// or its read cut) is not settled: the lost attempt may hold the key, and
// the caller is told so.
func TestIndeterminateNotSettledByCutRepeat(t *testing.T) {
	t.Parallel()
	for _, then := range []string{"unsettled", "settled"} {
		t.Run(then, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				tb := setup(t, sqllock.Options{})
				var calls atomic.Int64
				tb.b.acquire = func(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
					n := calls.Add(1)
					switch {
					case n == 1:
						_, err := tb.mem.TryAcquire(ctx, req)
						require.NoError(t, err)
						return sqllock.Lease{}, sqllock.ErrIndeterminate // applied, reply lost
					case then == "unsettled" || n == 2:
						return sqllock.Lease{}, fmt.Errorf("not sent: %w", context.DeadlineExceeded)
					}
					return tb.mem.TryAcquire(ctx, req)
				}
				g, err := tb.client.TryAcquire(t.Context(), "k", nil)
				if then == "unsettled" {
					require.ErrorIs(t, err, sqllock.ErrIndeterminate)
					require.True(t, held(t, tb.mem, "k"), "the lost attempt's grant")
					return
				}
				require.NoError(t, err)
				require.EqualValues(t, 1, g.Token(), "the repeat after the cut one got the grant back")
				require.NoError(t, g.Release(t.Context()))
			})
		})
	}
}
