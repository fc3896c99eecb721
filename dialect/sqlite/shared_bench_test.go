package sqlite

import (
	"context"
	"errors"
	"math/rand/v2"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// BenchmarkSharedPairs measures acquire + release pairs through the
// Backend on random keys of 10,000, one goroutine, synchronous=NORMAL:
// plain (exclusive, one-shot), marked (a waiting writer's exclusive
// request, acquire_mark) and shared (shared_acquire + shared_release). The
// targets: marked and shared within 1.2x the plain pair's time
// (docs/shared-locks.md):
//
//	go test -run '^$' -bench SharedPairs -count 6 ./dialect/sqlite
func BenchmarkSharedPairs(b *testing.B) {
	for _, mode := range []string{"plain", "marked", "shared"} {
		b.Run(mode, func(b *testing.B) {
			be, _ := openTest(b, Options{Synchronous: SynchronousNormal})
			ctx := context.Background()
			var owners atomic.Int64
			b.ResetTimer()
			for range b.N {
				req := sqllock.AcquireRequest{Key: "bench/" + strconv.Itoa(rand.N(benchKeys)), TTL: 30 * time.Second,
					Owner: "o" + strconv.FormatInt(owners.Add(1), 10), Mark: mode == "marked", Shared: mode == "shared"}
				l, err := be.TryAcquire(ctx, req)
				if errors.Is(err, sqllock.ErrNotAcquired) {
					continue
				}
				if err != nil {
					b.Fatal(err)
				}
				if err := be.Release(ctx, l); err != nil {
					b.Fatal(err)
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "pairs/s")
		})
	}
}
