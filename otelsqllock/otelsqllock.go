// Package otelsqllock records what a [sqllock.Client] does as
// OpenTelemetry metrics and spans. It is a Go module of its own, so that
// the library never imports OpenTelemetry: only programs that import this
// package do.
//
//	obs, err := otelsqllock.New(otelsqllock.Options{}) // the global providers
//	client, err := sqllock.New(backend, sqllock.Options{Observer: obs})
//
// It turns the events of the client's observer hook ([sqllock.Observer],
// set as sqllock.Options.Observer) into metrics and spans; the hook, and
// the client's log/slog records, are described in the repository's
// docs/observability.md.
//
// # Example
//
// A runnable example, printing both with the stdout exporters (go run
// ./otelsqllock/example):
//
//	import (
//		"go.opentelemetry.io/otel/exporters/stdout/stdoutmetric"
//		"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
//		sdkmetric "go.opentelemetry.io/otel/sdk/metric"
//		sdktrace "go.opentelemetry.io/otel/sdk/trace"
//
//		"github.com/ashlock/ashlock/otelsqllock"
//		"github.com/ashlock/ashlock/sqllock"
//	)
//
//	metricExp, _ := stdoutmetric.New(stdoutmetric.WithPrettyPrint()) // or the Prometheus / OTLP exporter
//	traceExp, _ := stdouttrace.New(stdouttrace.WithPrettyPrint())
//	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewPeriodicReader(metricExp)))
//	tp := sdktrace.NewTracerProvider(sdktrace.WithBatcher(traceExp))
//	defer mp.Shutdown(ctx)
//	defer tp.Shutdown(ctx)
//
//	obs, err := otelsqllock.New(otelsqllock.Options{MeterProvider: mp, TracerProvider: tp}) // zero Options: the global providers
//	client, err := sqllock.New(backend, sqllock.Options{Observer: obs})
//
// For Prometheus, pass a MeterProvider whose reader is
// go.opentelemetry.io/otel/exporters/prometheus's exporter; the dots become
// underscores and the unit a suffix (sqllock_acquire_duration_seconds).
//
// # Metrics
//
// Names follow the OpenTelemetry semantic conventions' style: dotted,
// durations as histograms in seconds, counts without a "_total" suffix.
// Their attributes are few and bounded: sqllock.outcome
// ([sqllock.Outcome.String]), sqllock.reason ([sqllock.LostReason.Name])
// and sqllock.backend (Options.BackendName of the client). A metric never
// carries the key, the token or the owner, which are unbounded.
//
//	sqllock.acquire.duration     histogram  s        one acquire request (each attempt of a call); outcome, backend
//	sqllock.wait.duration        histogram  s        an Acquire call (it waits) from start to end; outcome, backend
//	sqllock.wait.attempts        histogram  {attempt} the requests of an Acquire call; outcome, backend
//	sqllock.renew.duration       histogram  s        one renewal's round trip; outcome, backend
//	sqllock.renew.slack          histogram  s        time left before the local deadline when a renewal returned (0 if none); outcome, backend
//	sqllock.release.duration     histogram  s        a Guard's release; outcome, backend
//	sqllock.lease.active         updowncounter {lease} Guards holding their lease now; backend
//	sqllock.lease.hold.duration  histogram  s        how long a Guard held its lease; outcome (released, lost, canceled), backend
//	sqllock.lease.lost           counter    {lease}  leases lost; reason, backend
//
// A renewal's slack near 0 means the next slow renewal loses the lease.
// The outcomes are granted, held, renewed, released, lost, late, canceled,
// timeout, indeterminate, unavailable and error; the backends postgres,
// sqlite, memory, or Options.BackendName: few values each.
//
// # Spans
//
// sqllock.acquire (a TryAcquire or Acquire call), sqllock.renew (one
// renewal) and sqllock.release (a Guard's release), each with the
// attributes sqllock.key, sqllock.token, sqllock.owner, sqllock.outcome and
// sqllock.backend (acquire adds sqllock.attempts and sqllock.wait, renew
// sqllock.slack in seconds, release sqllock.held in seconds). A span is
// made when its event arrives, with the event's start and end times. Its
// parent is the span in the acquire's context: a Guard's renewals and
// release are children of the span that acquired it. A span's status is
// Error for the outcomes lost, late, timeout, indeterminate, unavailable
// and error.
//
// # Cost
//
// What an observer does with the events is its own cost: TryAcquire +
// Renew + Release on the memory backend takes 6 allocations per operation
// without an observer, 7 with one whose funcs do nothing or count (go test
// ./sqllock -run X -bench Observer), 26 with this package's metrics, and
// 44 with metrics and sampled spans (go test ./otelsqllock -run X -bench .).
package otelsqllock

import (
	"context"
	"sync"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/metric"
	"go.opentelemetry.io/otel/trace"

	"github.com/ashlock/ashlock/sqllock"
)

// ScopeName is the instrumentation scope of the meter and the tracer.
const ScopeName = "github.com/ashlock/ashlock/otelsqllock"

// Attribute keys.
const (
	AttrOutcome  = attribute.Key("sqllock.outcome")
	AttrReason   = attribute.Key("sqllock.reason")
	AttrBackend  = attribute.Key("sqllock.backend")
	AttrKey      = attribute.Key("sqllock.key")   // spans only
	AttrToken    = attribute.Key("sqllock.token") // spans only
	AttrOwner    = attribute.Key("sqllock.owner") // spans only
	AttrAttempts = attribute.Key("sqllock.attempts")
	AttrWait     = attribute.Key("sqllock.wait")  // Acquire's span: seconds waited
	AttrSlack    = attribute.Key("sqllock.slack") // renew's span: seconds
	AttrHeld     = attribute.Key("sqllock.held")  // release's span: seconds
)

// Options configure [New]. The zero value uses the global providers.
type Options struct {
	// MeterProvider makes the meter; default otel.GetMeterProvider().
	MeterProvider metric.MeterProvider
	// TracerProvider makes the tracer; default otel.GetTracerProvider().
	TracerProvider trace.TracerProvider
}

// Bucket boundaries, in seconds (or attempts): the defaults of the SDK are
// meant for milliseconds.
var (
	requestBuckets = []float64{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10}
	longBuckets    = []float64{0.001, 0.01, 0.1, 0.5, 1, 5, 10, 30, 60, 300, 900, 3600, 14400, 86400}
	slackBuckets   = []float64{0, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 300}
	attemptBuckets = []float64{1, 2, 3, 5, 10, 20, 50, 100, 1000}
)

type observer struct {
	tracer trace.Tracer

	acquire, wait, renew, slack, release, hold metric.Float64Histogram
	attempts                                   metric.Int64Histogram
	active                                     metric.Int64UpDownCounter
	lost                                       metric.Int64Counter

	mu    sync.RWMutex
	attrs map[attrKey]metric.MeasurementOption // the few attribute sets, made once
}

type attrKey struct {
	backend string
	outcome sqllock.Outcome
	reason  sqllock.LostReason
}

// New returns an Observer for [sqllock.Options] that records metrics and
// spans. It is safe for concurrent use and may be shared by Clients.
func New(opts Options) (*sqllock.Observer, error) {
	mp, tp := opts.MeterProvider, opts.TracerProvider
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	if tp == nil {
		tp = otel.GetTracerProvider()
	}
	m := mp.Meter(ScopeName)
	o := &observer{tracer: tp.Tracer(ScopeName), attrs: map[attrKey]metric.MeasurementOption{}}
	var err error
	hist := func(name, desc string, buckets []float64) metric.Float64Histogram {
		if err != nil {
			return nil
		}
		var h metric.Float64Histogram
		h, err = m.Float64Histogram(name, metric.WithUnit("s"), metric.WithDescription(desc), metric.WithExplicitBucketBoundaries(buckets...))
		return h
	}
	o.acquire = hist("sqllock.acquire.duration", "Duration of one acquire request.", requestBuckets)
	o.wait = hist("sqllock.wait.duration", "Time an Acquire call waited, from its start to its end.", longBuckets)
	o.renew = hist("sqllock.renew.duration", "Round trip of one renewal.", requestBuckets)
	o.slack = hist("sqllock.renew.slack", "Time left before the local deadline when a renewal returned (0 when it had passed).", slackBuckets)
	o.release = hist("sqllock.release.duration", "Duration of a lease's release.", requestBuckets)
	o.hold = hist("sqllock.lease.hold.duration", "How long a lease was held.", longBuckets)
	if err != nil {
		return nil, err
	}
	if o.attempts, err = m.Int64Histogram("sqllock.wait.attempts", metric.WithUnit("{attempt}"),
		metric.WithDescription("Acquire requests made by one Acquire call."), metric.WithExplicitBucketBoundaries(attemptBuckets...)); err != nil {
		return nil, err
	}
	if o.active, err = m.Int64UpDownCounter("sqllock.lease.active", metric.WithUnit("{lease}"),
		metric.WithDescription("Leases held now.")); err != nil {
		return nil, err
	}
	if o.lost, err = m.Int64Counter("sqllock.lease.lost", metric.WithUnit("{lease}"),
		metric.WithDescription("Leases lost, by reason.")); err != nil {
		return nil, err
	}
	return &sqllock.Observer{
		AcquireAttempt: o.acquireAttempt,
		Acquire:        o.acquireCall,
		Renew:          o.renewal,
		Release:        o.released,
		Lost:           o.leaseLost,
		GuardStart:     o.guardStart,
		GuardEnd:       o.guardEnd,
	}, nil
}

// attrSet returns the measurement option of one attribute combination; a
// zero outcome or reason is left out.
func (o *observer) attrSet(backend string, outcome sqllock.Outcome, reason sqllock.LostReason) metric.MeasurementOption {
	k := attrKey{backend, outcome, reason}
	o.mu.RLock()
	opt, ok := o.attrs[k]
	o.mu.RUnlock()
	if ok {
		return opt
	}
	kvs := []attribute.KeyValue{AttrBackend.String(backend)}
	if outcome != 0 {
		kvs = append(kvs, AttrOutcome.String(outcome.String()))
	}
	if reason != 0 {
		kvs = append(kvs, AttrReason.String(reason.Name()))
	}
	opt = metric.WithAttributeSet(attribute.NewSet(kvs...))
	o.mu.Lock()
	o.attrs[k] = opt
	o.mu.Unlock()
	return opt
}

func seconds(d time.Duration) float64 { return d.Seconds() }

// failed reports the outcomes that mark a span's status as Error.
func failed(o sqllock.Outcome) bool {
	switch o {
	case sqllock.OutcomeLost, sqllock.OutcomeLate, sqllock.OutcomeTimeout, sqllock.OutcomeIndeterminate,
		sqllock.OutcomeUnavailable, sqllock.OutcomeError:
		return true
	}
	return false
}

// span records a finished operation as a span, with the attributes attrs
// returns (not called unless the span records).
func (o *observer) span(ctx context.Context, name string, start time.Time, d time.Duration, outcome sqllock.Outcome, err error, attrs func() []attribute.KeyValue) {
	_, s := o.tracer.Start(ctx, name, trace.WithTimestamp(start), trace.WithSpanKind(trace.SpanKindInternal))
	if !s.IsRecording() {
		return
	}
	s.SetAttributes(attrs()...)
	if failed(outcome) {
		desc := outcome.String()
		if err != nil {
			desc = err.Error()
		}
		s.SetStatus(codes.Error, desc)
	}
	s.End(trace.WithTimestamp(start.Add(d)))
}

func common(key, owner, backend string, token int64, outcome sqllock.Outcome, more ...attribute.KeyValue) []attribute.KeyValue {
	return append([]attribute.KeyValue{
		AttrKey.String(key), AttrToken.Int64(token), AttrOwner.String(owner),
		AttrOutcome.String(outcome.String()), AttrBackend.String(backend),
	}, more...)
}

func (o *observer) acquireAttempt(ctx context.Context, e sqllock.AcquireAttemptEvent) {
	o.acquire.Record(ctx, seconds(e.Duration), o.attrSet(e.Backend, e.Outcome, 0))
}

func (o *observer) acquireCall(ctx context.Context, e sqllock.AcquireEvent) {
	if e.Wait {
		set := o.attrSet(e.Backend, e.Outcome, 0)
		o.wait.Record(ctx, seconds(e.Duration), set)
		o.attempts.Record(ctx, int64(e.Attempts), set)
	}
	o.span(ctx, "sqllock.acquire", e.Start, e.Duration, e.Outcome, e.Err, func() []attribute.KeyValue {
		attrs := common(e.Key, e.Owner, e.Backend, e.Token, e.Outcome, AttrAttempts.Int(e.Attempts))
		if e.Wait {
			attrs = append(attrs, AttrWait.Float64(seconds(e.Duration)))
		}
		return attrs
	})
}

func (o *observer) renewal(ctx context.Context, e sqllock.RenewEvent) {
	set := o.attrSet(e.Backend, e.Outcome, 0)
	o.renew.Record(ctx, seconds(e.Duration), set)
	// A histogram takes no negative values: a reply after the local
	// deadline (outcome late) had no slack left.
	o.slack.Record(ctx, seconds(max(e.Slack, 0)), set)
	o.span(ctx, "sqllock.renew", e.Start, e.Duration, e.Outcome, e.Err, func() []attribute.KeyValue {
		return common(e.Key, e.Owner, e.Backend, e.Token, e.Outcome, AttrSlack.Float64(seconds(e.Slack)))
	})
}

func (o *observer) released(ctx context.Context, e sqllock.ReleaseEvent) {
	o.release.Record(ctx, seconds(e.Duration), o.attrSet(e.Backend, e.Outcome, 0))
	o.span(ctx, "sqllock.release", e.Start, e.Duration, e.Outcome, e.Err, func() []attribute.KeyValue {
		return common(e.Key, e.Owner, e.Backend, e.Token, e.Outcome, AttrHeld.Float64(seconds(e.Held)))
	})
}

func (o *observer) leaseLost(ctx context.Context, e sqllock.LostEvent) {
	o.lost.Add(ctx, 1, o.attrSet(e.Backend, 0, e.Reason))
}

func (o *observer) guardStart(ctx context.Context, e sqllock.GuardEvent) {
	o.active.Add(ctx, 1, o.attrSet(e.Backend, 0, 0))
}

func (o *observer) guardEnd(ctx context.Context, e sqllock.GuardEvent) {
	o.active.Add(ctx, -1, o.attrSet(e.Backend, 0, 0))
	o.hold.Record(ctx, seconds(e.Held), o.attrSet(e.Backend, e.Outcome, 0))
}
