package sqllock_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

// BenchmarkMemoryBackend measures the backend alone: TryAcquire+Release
// pairs.
func BenchmarkMemoryBackend(b *testing.B) {
	ctx := context.Background()
	for _, keys := range []int{1, 10000} {
		names := make([]string, keys)
		for i := range names {
			names[i] = fmt.Sprintf("key-%d", i)
		}
		b.Run(fmt.Sprintf("keys=%d/serial", keys), func(b *testing.B) {
			be := memory.New()
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				l, err := be.TryAcquire(ctx, sqllock.AcquireRequest{Key: names[i%keys], TTL: sqllock.DefaultTTL, Owner: "o"})
				if err != nil {
					b.Fatal(err)
				}
				if err := be.Release(ctx, l); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("keys=%d/parallel", keys), func(b *testing.B) {
			be := memory.New()
			var n atomic.Uint64
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				owner := fmt.Sprintf("o%d", n.Add(1))
				i := int(n.Load()) * 7919
				for pb.Next() {
					i++
					l, err := be.TryAcquire(ctx, sqllock.AcquireRequest{Key: names[i%keys], TTL: sqllock.DefaultTTL, Owner: owner})
					if err != nil {
						continue // contended: another goroutine holds it
					}
					if err := be.Release(ctx, l); err != nil {
						b.Fatal(err)
					}
				}
			})
		})
	}
}

// BenchmarkClientPair measures the whole client: TryAcquire (a Guard with
// its watchdog) + Release, single key and many keys, serial and parallel.
func BenchmarkClientPair(b *testing.B) {
	ctx := context.Background()
	for _, keys := range []int{1, 10000} {
		names := make([]string, keys)
		for i := range names {
			names[i] = fmt.Sprintf("key-%d", i)
		}
		for _, parallel := range []bool{false, true} {
			b.Run(fmt.Sprintf("keys=%d/parallel=%v", keys, parallel), func(b *testing.B) {
				c, err := sqllock.New(memory.New(), sqllock.Options{})
				if err != nil {
					b.Fatal(err)
				}
				defer c.Close(ctx)
				var n atomic.Uint64
				pair := func(i int) {
					g, err := c.TryAcquire(ctx, names[i%keys], nil)
					if err != nil {
						return // contended
					}
					if err := g.Release(ctx); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportAllocs()
				if !parallel {
					for i := 0; b.Loop(); i++ {
						pair(i)
					}
					return
				}
				b.RunParallel(func(pb *testing.PB) {
					i := int(n.Add(1)) * 7919
					for pb.Next() {
						i++
						pair(i)
					}
				})
			})
		}
	}
}

// BenchmarkObserver measures what the Observer hook costs: TryAcquire,
// Renew and Release of one key (every event kind but a loss), with no
// observer (the default), with one whose funcs do nothing, and with one
// that counts the events. Compare allocs/op: without an observer the
// client allocates what it did before the hook; with one, one more per
// Guard (its events' state) and none for the events.
func BenchmarkObserver(b *testing.B) {
	ctx := context.Background()
	var n atomic.Int64
	noop := noopObserver()
	counting := &sqllock.Observer{
		AcquireAttempt: func(_ context.Context, e sqllock.AcquireAttemptEvent) { n.Add(int64(e.Duration)) },
		Acquire:        func(_ context.Context, e sqllock.AcquireEvent) { n.Add(int64(e.Attempts)) },
		Renew:          func(_ context.Context, e sqllock.RenewEvent) { n.Add(int64(e.Slack)) },
		Release:        func(_ context.Context, e sqllock.ReleaseEvent) { n.Add(int64(e.Held)) },
		Lost:           func(_ context.Context, e sqllock.LostEvent) { n.Add(int64(e.Reason)) },
		GuardStart:     func(_ context.Context, e sqllock.GuardEvent) { n.Add(e.Token) },
		GuardEnd:       func(_ context.Context, e sqllock.GuardEvent) { n.Add(int64(e.Outcome)) },
	}
	for _, tc := range []struct {
		name string
		obs  *sqllock.Observer
	}{{"none", nil}, {"noop", noop}, {"counting", counting}} {
		b.Run("observer="+tc.name, func(b *testing.B) {
			c, err := sqllock.New(memory.New(), sqllock.Options{Observer: tc.obs})
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
