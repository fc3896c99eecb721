package otelsqllock_test

import (
	"context"
	"testing"

	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/trace/noop"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/otelsqllock"
	"github.com/ashlock/ashlock/sqllock"
)

// BenchmarkObserver measures what recording costs: TryAcquire, Renew and
// Release of one key on the memory backend, with no observer, with
// otelsqllock's metrics only (a no-op tracer), and with metrics and
// sampled spans (an SDK tracer that exports nowhere).
func BenchmarkObserver(b *testing.B) {
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		obs  func(b *testing.B) *sqllock.Observer
	}{
		{"none", func(*testing.B) *sqllock.Observer { return nil }},
		{"metrics", func(b *testing.B) *sqllock.Observer {
			mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
			b.Cleanup(func() { _ = mp.Shutdown(ctx) })
			obs, err := otelsqllock.New(otelsqllock.Options{MeterProvider: mp, TracerProvider: noop.NewTracerProvider()})
			if err != nil {
				b.Fatal(err)
			}
			return obs
		}},
		{"metrics+spans", func(b *testing.B) *sqllock.Observer {
			mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(sdkmetric.NewManualReader()))
			tp := sdktrace.NewTracerProvider()
			b.Cleanup(func() { _ = mp.Shutdown(ctx); _ = tp.Shutdown(ctx) })
			obs, err := otelsqllock.New(otelsqllock.Options{MeterProvider: mp, TracerProvider: tp})
			if err != nil {
				b.Fatal(err)
			}
			return obs
		}},
	} {
		b.Run("observer="+tc.name, func(b *testing.B) {
			c, err := sqllock.New(memory.New(), sqllock.Options{Observer: tc.obs(b)})
			if err != nil {
				b.Fatal(err)
			}
			defer c.Close(ctx)
			b.ReportAllocs()
			for b.Loop() {
				g, err := c.TryAcquire(ctx, "k", nil)
				if err != nil {
					b.Fatal(err)
				}
				if _, err := g.Renew(ctx); err != nil {
					b.Fatal(err)
				}
				if err := g.Release(ctx); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
