// Command example records a few locks' metrics and spans with otelsqllock
// and prints them with OpenTelemetry's stdout exporters: the spans as they
// end, the metrics once at exit. It needs no database (it uses the memory
// backend); for PostgreSQL or SQLite only the backend changes.
//
//	go run ./otelsqllock/example
package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"go.opentelemetry.io/otel/exporters/stdout/stdoutmetric"
	"go.opentelemetry.io/otel/exporters/stdout/stdouttrace"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/otelsqllock"
	"github.com/ashlock/ashlock/sqllock"
)

func main() {
	if err := run(context.Background(), os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "example:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, w io.Writer) (err error) {
	// Exporters: here stdout; in production an OTLP or Prometheus exporter.
	metricExp, err := stdoutmetric.New(stdoutmetric.WithWriter(w), stdoutmetric.WithPrettyPrint())
	if err != nil {
		return err
	}
	traceExp, err := stdouttrace.New(stdouttrace.WithWriter(w), stdouttrace.WithPrettyPrint())
	if err != nil {
		return err
	}
	reader := sdkmetric.NewPeriodicReader(metricExp) // exports at Shutdown too
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(traceExp))
	defer func() { err = errors.Join(err, tp.Shutdown(ctx), mp.Shutdown(ctx)) }()

	obs, err := otelsqllock.New(otelsqllock.Options{MeterProvider: mp, TracerProvider: tp})
	if err != nil {
		return err
	}
	client, err := sqllock.New(memory.New(), sqllock.Options{Observer: obs, TTL: time.Second})
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, client.Close(ctx)) }()

	// A job under a lock, with one renewal on the way (every TTL/3).
	err = client.Do(ctx, "nightly-report", nil, func(ctx context.Context, g *sqllock.Guard) error {
		select {
		case <-time.After(400 * time.Millisecond):
			return nil
		case <-ctx.Done():
			return context.Cause(ctx)
		}
	})
	if err != nil {
		return err
	}
	// A second caller finds the key held.
	g, err := client.TryAcquire(ctx, "deploy", nil)
	if err != nil {
		return err
	}
	if _, err := client.TryAcquire(ctx, "deploy", nil); !errors.Is(err, sqllock.ErrNotAcquired) {
		return fmt.Errorf("second TryAcquire: %v, want ErrNotAcquired", err)
	}
	return g.Release(ctx)
}
