package sqllock_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

// recorder keeps every event an Observer receives, in order, with the
// context it came with.
type recorder struct {
	mu     sync.Mutex
	events []any
	ctxs   []context.Context
}

func (r *recorder) add(ctx context.Context, e any) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, e)
	r.ctxs = append(r.ctxs, ctx)
}

func (r *recorder) observer() *sqllock.Observer {
	return &sqllock.Observer{
		AcquireAttempt: func(ctx context.Context, e sqllock.AcquireAttemptEvent) { r.add(ctx, e) },
		Acquire:        func(ctx context.Context, e sqllock.AcquireEvent) { r.add(ctx, e) },
		Renew:          func(ctx context.Context, e sqllock.RenewEvent) { r.add(ctx, e) },
		Release:        func(ctx context.Context, e sqllock.ReleaseEvent) { r.add(ctx, e) },
		Lost:           func(ctx context.Context, e sqllock.LostEvent) { r.add(ctx, e) },
		GuardStart:     func(ctx context.Context, e sqllock.GuardEvent) { r.add(ctx, guardStart(e)) },
		GuardEnd:       func(ctx context.Context, e sqllock.GuardEvent) { r.add(ctx, guardEnd(e)) },
	}
}

// guardStart and guardEnd tell the two uses of GuardEvent apart.
type (
	guardStart sqllock.GuardEvent
	guardEnd   sqllock.GuardEvent
)

// of returns the recorded events of type T, in order.
func of[T any](r *recorder) []T {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []T
	for _, e := range r.events {
		if v, ok := e.(T); ok {
			out = append(out, v)
		}
	}
	return out
}

func filter[T any](s []T, keep func(T) bool) []T {
	var out []T
	for _, v := range s {
		if keep(v) {
			out = append(out, v)
		}
	}
	return out
}

// kinds names the recorded events in order, for the failure messages.
func (r *recorder) kinds() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var b strings.Builder
	for _, e := range r.events {
		switch e := e.(type) {
		case sqllock.AcquireAttemptEvent:
			b.WriteString("attempt:" + e.Outcome.String())
		case sqllock.AcquireEvent:
			b.WriteString("acquire:" + e.Outcome.String())
		case sqllock.RenewEvent:
			b.WriteString("renew:" + e.Outcome.String())
		case sqllock.ReleaseEvent:
			b.WriteString("release:" + e.Outcome.String())
		case sqllock.LostEvent:
			b.WriteString("lost:" + e.Reason.Name())
		case guardStart:
			b.WriteString("start")
		case guardEnd:
			b.WriteString("end:" + e.Outcome.String())
		}
		b.WriteString(" ")
	}
	return strings.TrimSpace(b.String())
}

func observed(t *testing.T, opts sqllock.Options) (*testBundle, *recorder) {
	t.Helper()
	r := &recorder{}
	opts.Observer = r.observer()
	return setup(t, opts), r
}

// margin is the default margin for the tests' TTL.
const margin = ttl/100 + 2*time.Millisecond

func TestObserverTryAcquireAndRelease(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb, r := observed(t, sqllock.Options{})
		const rtt = 10 * time.Millisecond
		tb.b.acquire = func(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
			time.Sleep(rtt)
			return tb.mem.TryAcquire(ctx, req)
		}
		type ctxKey struct{}
		ctx := context.WithValue(t.Context(), ctxKey{}, "caller")
		start := time.Now()
		g, err := tb.client.TryAcquire(ctx, "k", nil)
		require.NoError(t, err)
		require.Equal(t, "attempt:granted start acquire:granted", r.kinds())

		a := of[sqllock.AcquireAttemptEvent](r)[0]
		require.Equal(t, "k", a.Key)
		require.Equal(t, g.Lease().Owner, a.Owner)
		require.Equal(t, "sqllock_test", a.Backend, "the default BackendName: the package of the Backend's type")
		require.Equal(t, g.Token(), a.Token)
		require.Equal(t, start, a.Start)
		require.Equal(t, rtt, a.Duration)
		require.False(t, a.Settle)
		require.NoError(t, a.Err)

		c := of[sqllock.AcquireEvent](r)[0]
		require.Equal(t, sqllock.AcquireEvent{
			Key: "k", Owner: a.Owner, Backend: "sqllock_test", Token: g.Token(),
			Attempts: 1, Outcome: sqllock.OutcomeGranted, Start: start, Duration: rtt,
		}, c)
		s := of[guardStart](r)[0]
		require.Equal(t, guardStart{Key: "k", Owner: a.Owner, Backend: "sqllock_test", Token: g.Token(), Start: start}, s)
		for i, c := range r.ctxs {
			require.Equal(t, "caller", c.Value(ctxKey{}), "event %d carries the acquire's context values", i)
		}

		// Another call finds the key held: the holder's token.
		_, err = tb.client.TryAcquire(t.Context(), "k", nil)
		require.ErrorIs(t, err, sqllock.ErrNotAcquired)
		held := of[sqllock.AcquireAttemptEvent](r)[1]
		require.Equal(t, sqllock.OutcomeHeld, held.Outcome)
		require.Equal(t, g.Token(), held.Token)
		require.NotEqual(t, a.Owner, held.Owner)
		require.ErrorIs(t, held.Err, sqllock.ErrNotAcquired)
		require.Equal(t, sqllock.OutcomeHeld, of[sqllock.AcquireEvent](r)[1].Outcome)

		time.Sleep(interval / 2)
		relStart := time.Now()
		require.NoError(t, g.Release(t.Context()))
		require.Equal(t, "attempt:granted start acquire:granted attempt:held acquire:held end:released release:released", r.kinds())
		e := of[guardEnd](r)[0]
		require.Equal(t, sqllock.OutcomeReleased, e.Outcome)
		require.Equal(t, relStart.Sub(start), e.Held)
		require.ErrorIs(t, e.Err, sqllock.ErrReleased)
		rel := of[sqllock.ReleaseEvent](r)[0]
		require.Equal(t, relStart, rel.Start)
		require.Equal(t, e.Held, rel.Held)
		require.Equal(t, g.Token(), rel.Token)
		require.NoError(t, rel.Err)

		require.NoError(t, g.Release(t.Context()))
		require.Len(t, of[sqllock.ReleaseEvent](r), 1, "one release per Guard")
		require.Len(t, of[guardEnd](r), 1)
	})
}

func TestObserverAcquireWait(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb, r := observed(t, sqllock.Options{})
		holder, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		go func() {
			time.Sleep(time.Second)
			_ = holder.Release(context.Background())
		}()
		start := time.Now()
		g, err := tb.client.Acquire(t.Context(), "k", &sqllock.AcquireOptions{Wait: sqllock.WaitForever})
		require.NoError(t, err)
		waited := time.Since(start)
		require.GreaterOrEqual(t, waited, time.Second)

		calls := of[sqllock.AcquireEvent](r)
		require.Len(t, calls, 2)
		c := calls[1]
		require.True(t, c.Wait)
		require.Equal(t, sqllock.OutcomeGranted, c.Outcome)
		require.Equal(t, waited, c.Duration, "the total wait")
		require.Equal(t, g.Token(), c.Token)
		// Attempts counts this call's requests, each reported.
		var mine []sqllock.AcquireAttemptEvent
		for _, a := range of[sqllock.AcquireAttemptEvent](r) {
			if a.Owner == c.Owner {
				mine = append(mine, a)
			}
		}
		require.Greater(t, c.Attempts, 2)
		require.Len(t, mine, c.Attempts)
		for _, a := range mine[:len(mine)-1] {
			require.Equal(t, sqllock.OutcomeHeld, a.Outcome)
		}
		require.Equal(t, sqllock.OutcomeGranted, mine[len(mine)-1].Outcome)

		// A wait bounded by AcquireOptions.Wait ends in a timeout.
		_, err = tb.client.Acquire(t.Context(), "k", &sqllock.AcquireOptions{Wait: 300 * time.Millisecond})
		require.ErrorIs(t, err, sqllock.ErrNotAcquired)
		c = of[sqllock.AcquireEvent](r)[2]
		require.Equal(t, sqllock.OutcomeTimeout, c.Outcome)
		require.Equal(t, 300*time.Millisecond, c.Duration)
		require.Zero(t, c.Token)
		require.NoError(t, g.Release(t.Context()))
	})
}

// TestObserverSlackShrinks: slack = local deadline - reply time, so with
// renewals every interval it is TTL - margin - interval - round trip.
func TestObserverSlackShrinks(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb, r := observed(t, sqllock.Options{})
		delays := []time.Duration{100 * time.Millisecond, 400 * time.Millisecond, 800 * time.Millisecond}
		var n atomic.Int32
		tb.b.renew = func(ctx context.Context, l sqllock.Lease, d time.Duration) (sqllock.Lease, error) {
			i := int(n.Add(1)) - 1
			if i < len(delays) {
				time.Sleep(delays[i])
				return tb.mem.TryRenew(ctx, l, d)
			}
			// Then a success whose reply ignores ctx and arrives after the
			// local deadline: late, with a negative slack.
			nl, err := tb.mem.TryRenew(context.Background(), l, d)
			time.Sleep(ttl)
			return nl, err
		}
		start := time.Now()
		g, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		<-g.Done()
		time.Sleep(2 * ttl) // the late renewal returns
		renews := of[sqllock.RenewEvent](r)
		require.Len(t, renews, 4, r.kinds())
		for i, d := range delays {
			e := renews[i]
			require.Equal(t, sqllock.OutcomeRenewed, e.Outcome)
			require.Equal(t, start.Add(time.Duration(i+1)*interval), e.Start, "renewal %d", i)
			require.Equal(t, d, e.Duration, "renewal %d: the round trip", i)
			require.Equal(t, ttl-margin-interval-d, e.Slack, "renewal %d", i)
			require.Equal(t, g.Token(), e.Token)
			if i > 0 {
				require.Less(t, e.Slack, renews[i-1].Slack, "slack shrinks as renewals slow")
			}
		}
		late := renews[3]
		require.Equal(t, sqllock.OutcomeLate, late.Outcome)
		require.Equal(t, ttl-margin-interval-ttl, late.Slack, "negative: the reply came after the local deadline")
		require.NoError(t, late.Err)
		// The Guard was lost at its local deadline (unreachable), before
		// the late reply.
		lost := of[sqllock.LostEvent](r)
		require.Len(t, lost, 1)
		require.Equal(t, sqllock.LostUnreachable, lost[0].Reason)
		require.Equal(t, "unreachable", lost[0].Reason.Name())
		require.ErrorIs(t, g.Release(t.Context()), sqllock.ErrLeaseLost)
	})
}

func TestObserverLossReasons(t *testing.T) {
	t.Parallel()

	// check runs scenario, which must lose the Guard it is given, and checks
	// the events every loss has: one Lost with the reason, one GuardEnd
	// (lost) holding the same Held, and a release reporting the loss.
	check := func(t *testing.T, reason sqllock.LostReason, prepare func(tb *testBundle), scenario func(t *testing.T, tb *testBundle, g *sqllock.Guard)) *recorder {
		t.Helper()
		var r *recorder
		synctest.Test(t, func(t *testing.T) {
			var tb *testBundle
			tb, r = observed(t, sqllock.Options{})
			if prepare != nil {
				prepare(tb)
			}
			start := time.Now()
			g, err := tb.client.TryAcquire(t.Context(), "k", nil)
			require.NoError(t, err)
			scenario(t, tb, g)
			lostAt := time.Now()
			require.ErrorIs(t, g.Release(t.Context()), sqllock.ErrLeaseLost)

			mine := func(token int64) bool { return token == g.Token() }
			lost := of[sqllock.LostEvent](r)
			require.Len(t, lost, 1, r.kinds())
			require.Equal(t, reason, lost[0].Reason)
			require.Equal(t, g.Token(), lost[0].Token)
			require.Equal(t, lostAt.Sub(start), lost[0].Held)
			require.Equal(t, reason, lost[0].Err.Reason)
			ends := filter(of[guardEnd](r), func(e guardEnd) bool { return mine(e.Token) })
			require.Len(t, ends, 1)
			require.Equal(t, sqllock.OutcomeLost, ends[0].Outcome)
			require.Equal(t, lost[0].Held, ends[0].Held)
			require.ErrorIs(t, ends[0].Err, sqllock.ErrLeaseLost)
			rel := filter(of[sqllock.ReleaseEvent](r), func(e sqllock.ReleaseEvent) bool { return mine(e.Token) })
			require.Len(t, rel, 1)
			require.Equal(t, sqllock.OutcomeLost, rel[0].Outcome)
			require.Equal(t, lost[0].Held, rel[0].Held)
		})
		return r
	}

	t.Run("Released", func(t *testing.T) {
		t.Parallel()
		r := check(t, sqllock.LostReleased, nil, func(t *testing.T, tb *testBundle, g *sqllock.Guard) {
			l := g.Lease()
			require.NoError(t, tb.mem.Release(t.Context(), sqllock.Lease{Key: l.Key, Token: l.Token, Owner: "operator"}))
			<-g.Done() // the next renewal finds it
		})
		require.Equal(t, "attempt:granted start acquire:granted renew:lost lost:released end:lost release:lost", r.kinds())
	})
	t.Run("ReleasedFoundByRelease", func(t *testing.T) {
		t.Parallel()
		r := check(t, sqllock.LostReleased, nil, func(t *testing.T, tb *testBundle, g *sqllock.Guard) {
			l := g.Lease()
			require.NoError(t, tb.mem.Release(t.Context(), sqllock.Lease{Key: l.Key, Token: l.Token, Owner: "operator"}))
			time.Sleep(interval / 2) // no renewal before the release
		})
		require.Equal(t, "attempt:granted start acquire:granted lost:released end:lost release:lost", r.kinds())
		require.Equal(t, "operator", of[sqllock.LostEvent](r)[0].Err.By)
	})
	t.Run("Taken", func(t *testing.T) {
		t.Parallel()
		r := check(t, sqllock.LostTaken, nil, func(t *testing.T, tb *testBundle, g *sqllock.Guard) {
			tb.mem.Expire("k")
			other, err := tb.client.TryAcquire(t.Context(), "k", nil)
			require.NoError(t, err)
			require.NoError(t, other.Release(t.Context()))
			<-g.Done()
		})
		require.Equal(t, "attempt:granted start acquire:granted attempt:granted start acquire:granted end:released release:released renew:lost lost:taken end:lost release:lost", r.kinds())
	})
	t.Run("Unreachable", func(t *testing.T) {
		t.Parallel()
		r := check(t, sqllock.LostUnreachable, func(tb *testBundle) {
			tb.b.renew = func(context.Context, sqllock.Lease, time.Duration) (sqllock.Lease, error) {
				time.Sleep(10 * time.Millisecond)
				return sqllock.Lease{}, sqllock.ErrUnavailable
			}
		}, func(t *testing.T, tb *testBundle, g *sqllock.Guard) {
			<-g.Done()
		})
		// Renewals every backoff (100ms) from the interval on, each a
		// transient failure with less slack, until the local deadline.
		renews := of[sqllock.RenewEvent](r)
		require.Len(t, renews, 18, r.kinds())
		local := renews[0].Start.Add(-interval).Add(ttl - margin)
		for i, e := range renews {
			require.Equal(t, sqllock.OutcomeUnavailable, e.Outcome)
			require.ErrorIs(t, e.Err, sqllock.ErrUnavailable)
			require.Equal(t, local.Sub(e.Start.Add(e.Duration)), e.Slack, "renewal %d", i)
		}
		require.Equal(t, ttl-margin, of[sqllock.LostEvent](r)[0].Held, "lost at the local deadline")
	})
}

// lockedBuffer is a bytes.Buffer for a handler written to from several
// goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

// records decodes the JSON lines written so far.
func (l *lockedBuffer) records(t *testing.T) []map[string]any {
	t.Helper()
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []map[string]any
	dec := json.NewDecoder(bytes.NewReader(l.b.Bytes()))
	for dec.More() {
		var m map[string]any
		require.NoError(t, dec.Decode(&m))
		out = append(out, m)
	}
	return out
}

// ctxHandler adds the value of ctxKey in each record's context as "ctx":
// it shows that the client logs through the *Context methods.
type ctxHandler struct{ slog.Handler }

type logCtxKey struct{}

func (h ctxHandler) Handle(ctx context.Context, r slog.Record) error {
	if v, ok := ctx.Value(logCtxKey{}).(string); ok {
		r.AddAttrs(slog.String("ctx", v))
	}
	return h.Handler.Handle(ctx, r)
}

func TestLogRecords(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		var buf lockedBuffer
		log := slog.New(ctxHandler{slog.NewJSONHandler(&buf, &slog.HandlerOptions{Level: slog.LevelDebug})})
		tb := setup(t, sqllock.Options{Logger: log, BackendName: "mem"})
		var failures atomic.Int32
		failures.Store(1)
		tb.b.renew = func(ctx context.Context, l sqllock.Lease, d time.Duration) (sqllock.Lease, error) {
			if failures.Add(-1) >= 0 {
				return sqllock.Lease{}, errors.Join(sqllock.ErrUnavailable, errors.New("connection reset"))
			}
			return tb.mem.TryRenew(ctx, l, d)
		}
		ctx := context.WithValue(t.Context(), logCtxKey{}, "acquirer")
		g, err := tb.client.TryAcquire(ctx, "k", nil)
		require.NoError(t, err)
		time.Sleep(interval + interval/2) // one failure, one success
		require.NoError(t, g.Err())
		l := g.Lease()
		require.NoError(t, tb.mem.Release(t.Context(), sqllock.Lease{Key: l.Key, Token: l.Token, Owner: "operator"}))
		<-g.Done()
		require.ErrorIs(t, g.Release(t.Context()), sqllock.ErrLeaseLost)
		// The loss is logged by the goroutine that ended the Guard, which
		// may not have written it yet when Done is closed.
		synctest.Wait()

		recs := buf.records(t)
		require.Len(t, recs, 2, "%v", recs)
		common := func(r map[string]any) {
			t.Helper()
			require.Equal(t, "k", r["key"])
			require.Equal(t, float64(g.Token()), r["token"])
			require.Equal(t, l.Owner, r["owner"])
			require.Equal(t, "mem", r["backend"])
			require.Equal(t, "acquirer", r["ctx"], "logged with the Guard's context")
		}
		debug, warn := recs[0], recs[1]
		common(debug)
		require.Equal(t, "DEBUG", debug["level"])
		require.Equal(t, "sqllock: renewal failed, retrying", debug["msg"])
		require.Equal(t, float64(1), debug["attempt"])
		require.Contains(t, debug["err"], "connection reset")
		common(warn)
		require.Equal(t, "WARN", warn["level"])
		require.Equal(t, "sqllock: lease lost", warn["msg"])
		require.Equal(t, "released", warn["reason"])
	})
}

func TestObserverGuardEndsWithItsContext(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb, r := observed(t, sqllock.Options{})
		ctx, cancel := context.WithCancel(t.Context())
		g, err := tb.client.TryAcquire(ctx, "k", nil)
		require.NoError(t, err)
		time.Sleep(interval / 2)
		cancel()
		synctest.Wait() // the watchdog releases on the caller's behalf
		require.Equal(t, "attempt:granted start acquire:granted end:canceled release:released", r.kinds())
		e := of[guardEnd](r)[0]
		require.Equal(t, interval/2, e.Held)
		require.ErrorIs(t, e.Err, context.Canceled)
		require.NoError(t, g.Release(t.Context()))
		require.Len(t, of[guardEnd](r), 1)

		// Close releases what is held: every start has its end.
		for _, k := range []string{"a", "b", "c"} {
			_, err := tb.client.TryAcquire(t.Context(), k, nil)
			require.NoError(t, err)
		}
		require.NoError(t, tb.client.Close(t.Context()))
		require.Len(t, of[guardStart](r), 4)
		require.Len(t, of[guardEnd](r), 4)
		require.Len(t, of[sqllock.ReleaseEvent](r), 4)
	})
}

// An indeterminate acquire is settled by repeating it: the repeats are
// attempts too, marked Settle, and not counted in Attempts.
func TestObserverSettleAttempts(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb, r := observed(t, sqllock.Options{})
		var lost atomic.Bool
		lost.Store(true)
		tb.b.acquire = func(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
			l, err := tb.mem.TryAcquire(ctx, req)
			if err == nil && lost.Swap(false) {
				return sqllock.Lease{}, sqllock.ErrIndeterminate // applied, reply lost
			}
			return l, err
		}
		g, err := tb.client.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		require.Equal(t, "attempt:indeterminate attempt:granted start acquire:granted", r.kinds())
		attempts := of[sqllock.AcquireAttemptEvent](r)
		require.False(t, attempts[0].Settle)
		require.True(t, attempts[1].Settle)
		require.Equal(t, 1, of[sqllock.AcquireEvent](r)[0].Attempts)
		require.NoError(t, g.Release(t.Context()))
	})
}

// noopObserver has every func set, each doing nothing: it measures what
// building and delivering events costs.
func noopObserver() *sqllock.Observer {
	return &sqllock.Observer{
		AcquireAttempt: func(context.Context, sqllock.AcquireAttemptEvent) {},
		Acquire:        func(context.Context, sqllock.AcquireEvent) {},
		Renew:          func(context.Context, sqllock.RenewEvent) {},
		Release:        func(context.Context, sqllock.ReleaseEvent) {},
		Lost:           func(context.Context, sqllock.LostEvent) {},
		GuardStart:     func(context.Context, sqllock.GuardEvent) {},
		GuardEnd:       func(context.Context, sqllock.GuardEvent) {},
	}
}

// TestObserverAllocatesNothing: a client with an observer allocates what
// one without does, plus one small struct per Guard (its events' state,
// which a Guard without an observer does without), so building and
// delivering events allocates nothing. Not parallel: AllocsPerRun counts
// every goroutine's allocations. BenchmarkObserver reports the figures.
func TestObserverAllocatesNothing(t *testing.T) {
	ctx := context.Background()
	noop := noopObserver()
	allocs := func(obs *sqllock.Observer) float64 {
		c, err := sqllock.New(memory.New(), sqllock.Options{Observer: obs})
		require.NoError(t, err)
		defer c.Close(ctx)
		// A held key too: the refused attempt's event carries the
		// holder's token.
		holder, err := c.TryAcquire(ctx, "held", nil)
		require.NoError(t, err)
		defer holder.Release(ctx)
		return testing.AllocsPerRun(200, func() {
			g, err := c.TryAcquire(ctx, "k", nil)
			require.NoError(t, err)
			_, err = g.Renew(ctx)
			require.NoError(t, err)
			require.NoError(t, g.Release(ctx))
			_, err = c.TryAcquire(ctx, "held", nil)
			require.ErrorIs(t, err, sqllock.ErrNotAcquired)
		})
	}
	// Other goroutines (the runtime's, a timer's) allocate now and then
	// while a run is counted, and only ever add: the least of a few runs
	// is the loop's own count.
	least := func(obs *sqllock.Observer) float64 {
		n := allocs(obs)
		for range 4 {
			n = min(n, allocs(obs))
		}
		return n
	}
	none, with := least(nil), least(noop)
	t.Logf("allocs per TryAcquire+Renew+Release+refused TryAcquire: %.0f without an observer, %.0f with one", none, with)
	if raceEnabled {
		// sync.Pool drops items at random under the race detector: only
		// the bound holds there. .ci/run runs this test without -race too.
		require.LessOrEqual(t, with, none+1, "one Guard: at most one allocation for its events' state")
		return
	}
	require.Equal(t, none+1, with, "one Guard: one allocation for its events' state, none for the events")
}
