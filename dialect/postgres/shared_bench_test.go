package postgres

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// BenchmarkSharedPairs measures, on one goroutine and random keys from
// 10,000, the plain TryAcquire+Release pair beside a waiting writer's
// (Mark) and a shared one, interleaved in the same run: µs per pair
// (ns/op is the plain pair's) and each one's ratio to the plain pair
// (target <= 1.2, docs/shared-locks.md).
func BenchmarkSharedPairs(b *testing.B) {
	for _, g := range []int{1, 4} {
		b.Run(fmt.Sprintf("goroutines=%d", g), func(b *testing.B) {
			bundle := newBundle(b, Options{})
			be, err := New(benchPool(b, bundle), Options{})
			require.NoError(b, err)
			b.Cleanup(func() { be.Close() })
			pair := func(shared, mark bool) func(ctx context.Context, key, owner string) error {
				return func(ctx context.Context, key, owner string) error {
					l, err := be.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: owner, Shared: shared, Mark: mark})
					if errors.Is(err, sqllock.ErrNotAcquired) {
						return nil // two goroutines drew the same key
					}
					if err != nil {
						return err
					}
					return be.Release(ctx, l)
				}
			}
			cs := []*contender{{name: "plain", run: pair(false, false)}, {name: "marked", run: pair(false, true)}, {name: "shared", run: pair(true, false)}}
			race(b, g, 2*g, 10_000, cs)
			for _, c := range cs {
				c.time = 0
			}
			b.ResetTimer()
			race(b, g, b.N, 10_000, cs)
			b.ReportMetric(float64(cs[0].time.Nanoseconds())/float64(b.N), "ns/op")
			for _, c := range cs {
				b.ReportMetric(float64(c.time.Microseconds())/float64(b.N), c.name+"_µs/pair")
			}
			b.ReportMetric(cs[1].time.Seconds()/cs[0].time.Seconds(), "marked_ratio")
			b.ReportMetric(cs[2].time.Seconds()/cs[0].time.Seconds(), "shared_ratio")
		})
	}
}
