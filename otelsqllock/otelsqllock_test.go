package otelsqllock_test

import (
	"context"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.uber.org/goleak"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/otelsqllock"
	"github.com/ashlock/ashlock/sqllock"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// slow delays every backend call by rtt, so that durations are exact
// under synctest. It hides the memory backend's release signals: Acquire
// polls.
type slow struct {
	sqllock.Backend
	rtt time.Duration
}

func (s slow) TryAcquire(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	time.Sleep(s.rtt)
	return s.Backend.TryAcquire(ctx, req)
}

func (s slow) TryRenew(ctx context.Context, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
	time.Sleep(s.rtt)
	return s.Backend.TryRenew(ctx, l, ttl)
}

func (s slow) Release(ctx context.Context, l sqllock.Lease) error {
	time.Sleep(s.rtt)
	return s.Backend.Release(ctx, l)
}

type testBundle struct {
	mem    *memory.Backend
	client *sqllock.Client
	reader *sdkmetric.ManualReader
	spans  *tracetest.InMemoryExporter
	tp     *sdktrace.TracerProvider
}

const (
	ttl    = 3 * time.Second
	rtt    = 5 * time.Millisecond
	margin = ttl/100 + 2*time.Millisecond // the default
)

func setup(t *testing.T) *testBundle {
	t.Helper()
	tb := &testBundle{mem: memory.New(), reader: sdkmetric.NewManualReader(), spans: tracetest.NewInMemoryExporter()}
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(tb.reader))
	tb.tp = sdktrace.NewTracerProvider(sdktrace.WithSyncer(tb.spans))
	t.Cleanup(func() {
		require.NoError(t, mp.Shutdown(context.Background()))
		require.NoError(t, tb.tp.Shutdown(context.Background()))
	})
	obs, err := otelsqllock.New(otelsqllock.Options{MeterProvider: mp, TracerProvider: tb.tp})
	require.NoError(t, err)
	tb.client, err = sqllock.New(slow{tb.mem, rtt}, sqllock.Options{
		TTL: ttl, Observer: obs, BackendName: "memory",
		Backoff: func(int) time.Duration { return 100 * time.Millisecond },
	})
	require.NoError(t, err)
	t.Cleanup(func() { _ = tb.client.Close(context.Background()) })
	return tb
}

// collect returns the metrics by name.
func (tb *testBundle) collect(t *testing.T) map[string]metricdata.Metrics {
	t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(t, tb.reader.Collect(context.Background(), &rm))
	out := map[string]metricdata.Metrics{}
	for _, sm := range rm.ScopeMetrics {
		require.Equal(t, otelsqllock.ScopeName, sm.Scope.Name)
		for _, m := range sm.Metrics {
			out[m.Name] = m
		}
	}
	return out
}

// point is one histogram data point, in a comparable form.
type point struct {
	attrs string // "outcome=granted" and the like, sorted, backend left out
	count uint64
	sum   float64
}

func attrString(t *testing.T, set attribute.Set) string {
	t.Helper()
	s := ""
	for _, kv := range set.ToSlice() {
		switch kv.Key {
		case otelsqllock.AttrBackend:
			require.Equal(t, "memory", kv.Value.AsString())
			continue
		case otelsqllock.AttrOutcome, otelsqllock.AttrReason:
		default:
			t.Fatalf("metric attribute %s: only outcome, reason and backend are allowed", kv.Key)
		}
		if s != "" {
			s += ","
		}
		s += string(kv.Key)[len("sqllock."):] + "=" + kv.Value.AsString()
	}
	return s
}

func histogram[N int64 | float64](t *testing.T, m metricdata.Metrics) map[string]point {
	t.Helper()
	h, ok := m.Data.(metricdata.Histogram[N])
	require.True(t, ok, "%s is a %T", m.Name, m.Data)
	out := map[string]point{}
	for _, dp := range h.DataPoints {
		k := attrString(t, dp.Attributes)
		out[k] = point{attrs: k, count: dp.Count, sum: round(float64(dp.Sum))}
	}
	return out
}

// round drops float noise below a microsecond.
func round(f float64) float64 { return float64(int64(f*1e6+0.5)) / 1e6 }

func sum(t *testing.T, m metricdata.Metrics) map[string]int64 {
	t.Helper()
	s, ok := m.Data.(metricdata.Sum[int64])
	require.True(t, ok, "%s is a %T", m.Name, m.Data)
	out := map[string]int64{}
	for _, dp := range s.DataPoints {
		out[attrString(t, dp.Attributes)] = dp.Value
	}
	return out
}

// TestScriptedScenario runs a known sequence of lock operations and checks
// every metric and span it leaves: names, units, attributes and counts.
func TestScriptedScenario(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t)
		ctx, request := tb.tp.Tracer("test").Start(t.Context(), "request")

		// Granted, then held for a second caller.
		g1, err := tb.client.TryAcquire(ctx, "job/1", nil)
		require.NoError(t, err)
		t0 := time.Now().Add(-rtt) // the request's send time
		_, err = tb.client.TryAcquire(ctx, "job/1", nil)
		require.ErrorIs(t, err, sqllock.ErrNotAcquired)
		require.Equal(t, map[string]int64{"": 1}, sum(t, tb.collect(t)["sqllock.lease.active"]))

		// One renewal at t0+1s.
		time.Sleep(time.Until(t0.Add(1500 * time.Millisecond)))
		// A waiting Acquire gives up after 300ms: attempts at +0, +105ms,
		// +210ms (5ms each, 100ms backoff), the wait ends at +300ms.
		_, err = tb.client.Acquire(ctx, "job/1", &sqllock.AcquireOptions{Wait: 300 * time.Millisecond})
		require.ErrorIs(t, err, sqllock.ErrNotAcquired)

		// A forced release, found by the renewal at t0+2s: lost.
		l := g1.Lease()
		require.NoError(t, tb.mem.Release(ctx, sqllock.Lease{Key: l.Key, Token: l.Token, Owner: "operator"}))
		<-g1.Done()
		require.Equal(t, t0.Add(2*time.Second+rtt), time.Now())
		require.ErrorIs(t, g1.Release(ctx), sqllock.ErrLeaseLost)

		// Another key, held for half a second and released.
		g2, err := tb.client.TryAcquire(ctx, "job/2", nil)
		require.NoError(t, err)
		time.Sleep(500 * time.Millisecond)
		require.NoError(t, g2.Release(ctx))
		request.End()

		ms := tb.collect(t)
		units := map[string]string{
			"sqllock.acquire.duration":    "s",
			"sqllock.wait.duration":       "s",
			"sqllock.wait.attempts":       "{attempt}",
			"sqllock.renew.duration":      "s",
			"sqllock.renew.slack":         "s",
			"sqllock.release.duration":    "s",
			"sqllock.lease.active":        "{lease}",
			"sqllock.lease.hold.duration": "s",
			"sqllock.lease.lost":          "{lease}",
		}
		got := map[string]string{}
		for name, m := range ms {
			got[name] = m.Unit
			require.NotEmpty(t, m.Description, name)
		}
		require.Equal(t, units, got)

		h := func(name string) map[string]point { return histogram[float64](t, ms[name]) }
		require.Equal(t, map[string]point{
			"outcome=granted": {"outcome=granted", 2, 2 * rtt.Seconds()},
			"outcome=held":    {"outcome=held", 4, 4 * rtt.Seconds()},
		}, h("sqllock.acquire.duration"))
		require.Equal(t, map[string]point{"outcome=timeout": {"outcome=timeout", 1, 0.3}}, h("sqllock.wait.duration"))
		require.Equal(t, map[string]point{"outcome=timeout": {"outcome=timeout", 1, 3}}, histogram[int64](t, ms["sqllock.wait.attempts"]))
		require.Equal(t, map[string]point{
			"outcome=renewed": {"outcome=renewed", 1, rtt.Seconds()},
			"outcome=lost":    {"outcome=lost", 1, rtt.Seconds()},
		}, h("sqllock.renew.duration"))
		// Slack: the local deadline (t0 + ttl - margin, then + 1s) less
		// the reply time (t0 + 1s + rtt, t0 + 2s + rtt).
		slack := (ttl - margin - time.Second - rtt).Seconds()
		require.Equal(t, map[string]point{
			"outcome=renewed": {"outcome=renewed", 1, round(slack)},
			"outcome=lost":    {"outcome=lost", 1, round(slack)},
		}, h("sqllock.renew.slack"))
		require.Equal(t, map[string]point{
			"outcome=lost":     {"outcome=lost", 1, 0}, // nothing sent: released by another
			"outcome=released": {"outcome=released", 1, rtt.Seconds()},
		}, h("sqllock.release.duration"))
		require.Equal(t, map[string]point{
			"outcome=lost":     {"outcome=lost", 1, (2*time.Second + rtt).Seconds()},
			"outcome=released": {"outcome=released", 1, (500*time.Millisecond + rtt).Seconds()},
		}, h("sqllock.lease.hold.duration"))
		require.Equal(t, map[string]int64{"": 0}, sum(t, ms["sqllock.lease.active"]))
		require.Equal(t, map[string]int64{"reason=released": 1}, sum(t, ms["sqllock.lease.lost"]))

		// Spans: the key, token and outcome; children of the request.
		type span struct {
			name, key, outcome string
			token              int64
			err                bool
		}
		var spans []span
		for _, s := range tb.spans.GetSpans() {
			if s.Name == "request" {
				continue
			}
			require.Equal(t, request.SpanContext().SpanID(), s.Parent.SpanID(), s.Name)
			require.Equal(t, otelsqllock.ScopeName, s.InstrumentationScope.Name)
			attrs := attribute.NewSet(s.Attributes...)
			key, _ := attrs.Value(otelsqllock.AttrKey)
			token, _ := attrs.Value(otelsqllock.AttrToken)
			outcome, _ := attrs.Value(otelsqllock.AttrOutcome)
			owner, _ := attrs.Value(otelsqllock.AttrOwner)
			require.NotEmpty(t, owner.AsString())
			spans = append(spans, span{s.Name, key.AsString(), outcome.AsString(), token.AsInt64(), s.Status.Code == codes.Error})
			require.True(t, s.EndTime.Sub(s.StartTime) >= 0)
		}
		require.Equal(t, []span{
			{"sqllock.acquire", "job/1", "granted", 1, false},
			{"sqllock.acquire", "job/1", "held", 0, false},
			{"sqllock.renew", "job/1", "renewed", 1, false},
			{"sqllock.acquire", "job/1", "timeout", 0, true},
			{"sqllock.renew", "job/1", "lost", 1, true},
			{"sqllock.release", "job/1", "lost", 1, true},
			{"sqllock.acquire", "job/2", "granted", 1, false},
			{"sqllock.release", "job/2", "released", 1, false},
		}, spans)
	})
}
