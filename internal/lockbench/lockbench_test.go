package lockbench

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

func TestHistQuantile(t *testing.T) {
	t.Parallel()
	var h, other Hist
	for i := 1; i <= 1000; i++ {
		if i%2 == 0 {
			h.Add(time.Duration(i) * time.Microsecond)
		} else {
			other.Add(time.Duration(i) * time.Microsecond)
		}
	}
	h.Merge(&other)
	require.Equal(t, uint64(1000), h.N())
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 500 * time.Microsecond}, {0.99, 990 * time.Microsecond}, {1, 1000 * time.Microsecond}} {
		got := h.Quantile(c.q)
		diff := float64(got-c.want) / float64(c.want)
		require.InDelta(t, 0, diff, 0.01, "Quantile(%v) = %v, want %v ±1%%", c.q, got, c.want)
	}
	var small Hist
	small.Add(3)
	require.Equal(t, time.Duration(3), small.Quantile(0.5))
	var empty Hist
	require.Equal(t, time.Duration(0), empty.Quantile(0.5))
}

func TestRun(t *testing.T) {
	t.Parallel()
	type testBundle struct {
		b   *memory.Backend
		ctx context.Context
	}
	setup := func(t *testing.T) *testBundle {
		t.Helper()
		return &testBundle{b: memory.New(), ctx: context.Background()}
	}
	keyOf := func(k string) func() string { return func() string { return k } }

	t.Run("PairCountsHeldOperations", func(t *testing.T) {
		t.Parallel()
		bundle := setup(t)
		ops := []Op{
			Pair(bundle.b, keyOf("a"), time.Minute, Owner("w0")),
			Pair(bundle.b, keyOf("b"), time.Minute, Owner("w1")),
		}
		r := Run(bundle.ctx, ops, 50*time.Millisecond, RunOptions{Latency: true})
		require.Positive(t, r.Ops)
		require.Zero(t, r.Busy)
		require.Zero(t, r.Errors, "%v", r.FirstError)
		require.Equal(t, r.Ops, r.Latency.N())
		require.GreaterOrEqual(t, r.Elapsed, 50*time.Millisecond)
		infos, err := bundle.b.List(bundle.ctx, "")
		require.NoError(t, err)
		for _, in := range infos {
			require.False(t, in.Held, "every pair released its lease: %+v", in)
		}
	})

	t.Run("BusyKeyIsNotAnOperation", func(t *testing.T) {
		t.Parallel()
		bundle := setup(t)
		_, err := bundle.b.TryAcquire(bundle.ctx, sqllock.AcquireRequest{Key: "held", TTL: time.Hour, Owner: "holder"})
		require.NoError(t, err)
		pair := Run(bundle.ctx, []Op{Pair(bundle.b, keyOf("held"), time.Minute, Owner("w"))}, 20*time.Millisecond, RunOptions{})
		require.Zero(t, pair.Ops)
		require.Positive(t, pair.Busy)
		// A hot key's refusals are what Attempt measures.
		hot := Run(bundle.ctx, []Op{Attempt(bundle.b, "held", time.Minute, Owner("w"))}, 20*time.Millisecond, RunOptions{CountBusy: true, Latency: true})
		require.Positive(t, hot.Ops)
		require.Equal(t, hot.Ops, hot.Busy)
		require.Equal(t, hot.Ops, hot.Latency.N())
		require.Zero(t, hot.Errors)
	})

	t.Run("AttemptGrantedIsErrStole", func(t *testing.T) {
		t.Parallel()
		bundle := setup(t)
		r := Run(bundle.ctx, []Op{Attempt(bundle.b, "free", time.Minute, Owner("w"))}, 20*time.Millisecond, RunOptions{CountBusy: true})
		require.Positive(t, r.Errors)
		require.ErrorIs(t, r.FirstError, ErrStole)
		infos, err := bundle.b.List(bundle.ctx, "free")
		require.NoError(t, err)
		require.Len(t, infos, 1)
		require.False(t, infos[0].Held, "the stolen lease was given back")
	})

	t.Run("FailuresAreCountedWithTheFirst", func(t *testing.T) {
		t.Parallel()
		bundle := setup(t)
		n := 0
		op := func(context.Context) (bool, error) {
			n++
			return false, fmt.Errorf("failure %d", n)
		}
		r := Run(bundle.ctx, []Op{op}, 20*time.Millisecond, RunOptions{})
		require.Positive(t, r.Errors)
		require.EqualError(t, r.FirstError, "failure 1")
		require.Zero(t, r.Ops)
	})

	t.Run("HooksAndOverFrameTheRun", func(t *testing.T) {
		t.Parallel()
		bundle := setup(t)
		over := make(chan struct{})
		var events []string
		op := func(ctx context.Context) (bool, error) {
			<-over // an Op that waits for the end of the run is released by it
			return true, nil
		}
		r := Run(bundle.ctx, []Op{op}, 20*time.Millisecond, RunOptions{
			Over:    over,
			Started: func() { events = append(events, "started") },
			Stopped: func() { events = append(events, "stopped") },
		})
		require.Equal(t, []string{"started", "stopped"}, events)
		require.Equal(t, uint64(1), r.Ops)
	})

	t.Run("InterruptIsNotAFailure", func(t *testing.T) {
		t.Parallel()
		ctx, cancel := context.WithCancel(context.Background())
		op := func(ctx context.Context) (bool, error) {
			cancel()
			<-ctx.Done()
			return false, ctx.Err()
		}
		over := make(chan struct{})
		r := Run(ctx, []Op{op}, 500*time.Millisecond, RunOptions{Over: over})
		require.Zero(t, r.Errors)
		require.Less(t, r.Elapsed, 400*time.Millisecond, "the worker stopped at the interrupt")
		select {
		case <-over:
		default:
			t.Fatal("Over is closed when the run ends early")
		}
		require.True(t, errors.Is(ctx.Err(), context.Canceled))
	})
}

func TestHandoff(t *testing.T) {
	t.Parallel()
	type testBundle struct {
		b      *memory.Backend
		client *sqllock.Client
		ctx    context.Context
	}
	setup := func(t *testing.T) *testBundle {
		t.Helper()
		b := memory.New()
		c, err := sqllock.New(b, sqllock.Options{Owner: "handoff"})
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, c.Close(context.Background())) })
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		t.Cleanup(cancel)
		return &testBundle{b: b, client: c, ctx: ctx}
	}

	t.Run("TakeoversAreCountedAndTimed", func(t *testing.T) {
		t.Parallel()
		bundle := setup(t)
		h := NewHandoff(bundle.client, []string{"h/0", "h/1"}, 4)
		r := Run(bundle.ctx, h.Ops(), 100*time.Millisecond, RunOptions{Over: h.Over})
		require.Zero(t, r.Errors, "%v", r.FirstError)
		require.Positive(t, r.Ops)
		require.Equal(t, r.Ops, h.Latency().N(), "one latency per handoff")
		infos, err := bundle.b.List(bundle.ctx, "h/")
		require.NoError(t, err)
		require.Len(t, infos, 2)
		for _, in := range infos {
			require.False(t, in.Held, "every holder released: %+v", in)
		}
	})

	t.Run("ALoneHolderStopsAtTheEnd", func(t *testing.T) {
		t.Parallel()
		bundle := setup(t)
		// One worker per key: no one takes the key from it, so no handoff,
		// and its wait for the next holder ends with the run.
		h := NewHandoff(bundle.client, []string{"a", "b"}, 2)
		r := Run(bundle.ctx, h.Ops(), 50*time.Millisecond, RunOptions{Over: h.Over})
		require.Zero(t, r.Ops)
		require.Equal(t, uint64(2), r.Busy)
		require.Less(t, r.Elapsed, 2*time.Second, "the holders stopped waiting at the end of the run")
		require.NoError(t, bundle.ctx.Err())
	})
}
