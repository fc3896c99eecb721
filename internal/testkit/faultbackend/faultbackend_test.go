package faultbackend_test

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/ashlock/ashlock/internal/testkit/faultbackend"
	"github.com/ashlock/ashlock/internal/testkit/history"
	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type testBundle struct {
	clock *faultbackend.Clock
	mem   *memory.Backend
	rec   *history.Recorder
	db    *faultbackend.DB
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	clock := faultbackend.NewClock(nil)
	mem := memory.NewWithClock(clock.Now)
	rec := history.NewRecorder(t.Name(), 1, history.Params{})
	db := faultbackend.NewDB(mem, faultbackend.DBOptions{Clock: clock, Recorder: rec, Audit: true})
	return &testBundle{clock: clock, mem: mem, rec: rec, db: db}
}

func (tb *testBundle) client(kind faultbackend.Kind) *faultbackend.Backend {
	cfg := faultbackend.Config{Client: 0, Seed: 1, MaxDelay: time.Second}
	if kind != "" {
		cfg.Prob = map[faultbackend.Kind]float64{kind: 1}
	}
	return tb.db.Client(cfg)
}

func held(t *testing.T, mem *memory.Backend, key string) bool {
	t.Helper()
	infos, err := mem.List(context.Background(), key)
	require.NoError(t, err)
	return len(infos) == 1 && infos[0].Held
}

var req = sqllock.AcquireRequest{Key: "k", TTL: 10 * time.Second, Owner: "o/1"}

func TestFailBeforeIsNotApplied(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t)
		_, err := tb.client(faultbackend.FailBefore).TryAcquire(t.Context(), req)
		require.ErrorIs(t, err, sqllock.ErrUnavailable)
		require.False(t, held(t, tb.mem, "k"))
		require.Equal(t, int64(1), tb.db.Counts()[faultbackend.FailBefore])
		h := tb.rec.History()
		require.Len(t, h.Ops, 1)
		require.Equal(t, history.Unavailable, h.Ops[0].Outcome)
		require.Zero(t, h.Ops[0].Audit)
		require.Empty(t, h.Audit)
	})
}

func TestFailAfterIsAppliedAndIndeterminate(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t)
		fb := tb.client(faultbackend.FailAfter)
		_, err := fb.TryAcquire(t.Context(), req)
		require.ErrorIs(t, err, sqllock.ErrIndeterminate)
		require.True(t, held(t, tb.mem, "k"))

		l, err := tb.mem.TryAcquire(t.Context(), req) // the same owner gets its grant back
		require.NoError(t, err)
		_, err = fb.TryRenew(t.Context(), l, 10*time.Second)
		require.ErrorIs(t, err, sqllock.ErrUnavailable, "a renew whose reply is lost is a transient error")
		require.ErrorIs(t, fb.Release(t.Context(), l), sqllock.ErrIndeterminate)
		require.False(t, held(t, tb.mem, "k"))
		require.Equal(t, int64(3), tb.db.Counts()[faultbackend.FailAfter])
		h := tb.rec.History()
		require.Len(t, h.Audit, 3)
		for _, op := range h.Ops {
			require.NotZero(t, op.Audit, "op %d applied", op.ID)
		}
	})
}

func TestDelayLandsAfterTheCallerGaveUp(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t)
		fb := tb.client(faultbackend.Delay)
		start := time.Now()
		_, err := fb.TryAcquire(t.Context(), req)
		require.NoError(t, err)
		require.Positive(t, time.Since(start))
		require.LessOrEqual(t, time.Since(start), 2*time.Second)
		require.True(t, held(t, tb.mem, "k"))

		// A caller that gives up at once: the request still lands.
		ctx, cancel := context.WithTimeout(t.Context(), time.Nanosecond)
		defer cancel()
		r2 := req
		r2.Key = "k2"
		_, err = fb.TryAcquire(ctx, r2)
		require.ErrorIs(t, err, sqllock.ErrIndeterminate)
		tb.db.Wait()
		require.True(t, held(t, tb.mem, "k2"))
	})
}

func TestHangWaitsForTheContext(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t)
		ctx, cancel := context.WithTimeout(t.Context(), 3*time.Second)
		defer cancel()
		start := time.Now()
		_, err := tb.client(faultbackend.Hang).TryAcquire(ctx, req)
		require.ErrorIs(t, err, sqllock.ErrIndeterminate)
		require.Equal(t, 3*time.Second, time.Since(start))
		require.Equal(t, int64(1), tb.db.Counts()[faultbackend.Hang])
	})
}

func TestKillStopsEveryRequest(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t)
		fb := tb.client("")
		l, err := fb.TryAcquire(t.Context(), req)
		require.NoError(t, err)
		fb.Kill()
		ctx, cancel := context.WithTimeout(t.Context(), time.Second)
		defer cancel()
		require.ErrorIs(t, fb.Release(ctx, l), sqllock.ErrUnavailable)
		require.True(t, held(t, tb.mem, "k"), "a dead client's release never arrives")
	})
}

func TestStepClockExpiresEarly(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t)
		fb := tb.client("")
		_, err := fb.TryAcquire(t.Context(), req)
		require.NoError(t, err)
		tb.db.StepClock(10 * time.Second)
		require.Equal(t, 10*time.Second, tb.clock.Offset())
		require.False(t, held(t, tb.mem, "k"))
		require.Equal(t, int64(1), tb.db.Counts()[faultbackend.ClockJump])
		tb.db.Expire("k")
		h := tb.rec.History()
		require.Len(t, h.Events, 2)
	})
}

// The faults a client gets depend only on the seed and its calls.
func TestDrawsAreSeeded(t *testing.T) {
	t.Parallel()
	outcomes := func(seed uint64) []history.Outcome {
		var out []history.Outcome
		synctest.Test(t, func(t *testing.T) {
			tb := setup(t)
			fb := tb.db.Client(faultbackend.Config{Seed: seed, MaxDelay: time.Millisecond,
				Prob: map[faultbackend.Kind]float64{faultbackend.FailBefore: 0.3, faultbackend.FailAfter: 0.3}})
			for range 50 {
				_, err := fb.TryAcquire(t.Context(), req)
				out = append(out, history.Classify(err))
			}
		})
		return out
	}
	a := outcomes(7)
	require.Equal(t, a, outcomes(7))
	require.NotEqual(t, a, outcomes(8))
	require.Contains(t, a, history.Unavailable)
	require.Contains(t, a, history.Indeterminate)
}
