package postgres

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// BenchmarkSharedPairs measures the plain TryAcquire+Release pair beside a
// waiting writer's (Mark) and a shared one, interleaved in the same run:
// µs per pair (ns/op is the plain pair's) and each one's ratio to the
// plain pair (target <= 1.2, docs/shared-locks.md). keys=first gives
// every pair a key never used before (each grant is its key's first: a
// shared one inserts K's row and its slot's, a plain one K's row);
// keys=100 draws from 100 keys, each used again and again (a grant
// updates rows that are there).
func BenchmarkSharedPairs(b *testing.B) {
	for _, g := range []int{1, 4} {
		b.Run(fmt.Sprintf("goroutines=%d", g), func(b *testing.B) {
			for _, keys := range []string{"first", "100"} {
				b.Run("keys="+keys, func(b *testing.B) { benchSharedPairs(b, g, keys == "first") })
			}
		})
	}
}

func benchSharedPairs(b *testing.B, g int, first bool) {
	bundle := newBundle(b, Options{})
	be, err := New(benchPool(b, bundle), Options{})
	require.NoError(b, err)
	b.Cleanup(func() { be.Close() })
	var fresh atomic.Int64
	pair := func(shared, mark bool) func(ctx context.Context, key, owner string) error {
		return func(ctx context.Context, key, owner string) error {
			if first {
				key = fmt.Sprint(key, "/", fresh.Add(1))
			}
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
	keys := 100
	if first {
		keys = 1 // and a fresh suffix each time
	}
	cs := []*contender{{name: "plain", run: pair(false, false)}, {name: "marked", run: pair(false, true)}, {name: "shared", run: pair(true, false)}}
	race(b, g, 2*g, keys, cs)
	for _, c := range cs {
		c.time = 0
	}
	b.ResetTimer()
	race(b, g, b.N, keys, cs)
	b.ReportMetric(float64(cs[0].time.Nanoseconds())/float64(b.N), "ns/op")
	for _, c := range cs {
		b.ReportMetric(float64(c.time.Microseconds())/float64(b.N), c.name+"_µs/pair")
	}
	b.ReportMetric(cs[1].time.Seconds()/cs[0].time.Seconds(), "marked_ratio")
	b.ReportMetric(cs[2].time.Seconds()/cs[0].time.Seconds(), "shared_ratio")
}
