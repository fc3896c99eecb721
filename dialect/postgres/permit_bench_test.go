package postgres

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// BenchmarkPermitPair measures permit acquire + release pairs on random
// semaphores of N = 1, 4 and 16 permits (from 1,000 semaphores), beside
// single-key TryAcquire + Release pairs (from 10,000 keys) through the
// same Backend in the same run, interleaved in rounds. Metrics: pairs/s
// of the single key, permitN_pairs/s and permitN_ratio (the single key's
// rate over the permit's: the cost of a permit relative to a key's pair;
// target <= 1.2), every semaphore created before the timed run. Run:
// SQLLOCK_REQUIRE_POSTGRES=1 go test -run '^$' -bench BenchmarkPermitPair
// ./dialect/postgres
func BenchmarkPermitPair(b *testing.B) {
	for _, g := range []int{1, 16, 64} {
		b.Run(fmt.Sprintf("goroutines=%d", g), func(b *testing.B) {
			bundle := newBundle(b, Options{})
			pool := newPool(b, bundle, func(cfg *pgxpool.Config) { cfg.MaxConns = 64 })
			be, err := New(pool, Options{})
			require.NoError(b, err)
			b.Cleanup(func() { be.Close() })
			single := &contender{name: "key", run: func(ctx context.Context, key, owner string) error {
				l, err := be.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: owner})
				if errors.Is(err, sqllock.ErrNotAcquired) {
					return nil
				}
				if err != nil {
					return err
				}
				return be.Release(ctx, l)
			}}
			cs := []*contender{single}
			for _, n := range []int{1, 4, 16} {
				cs = append(cs, &contender{name: fmt.Sprintf("permit%d", n), run: func(ctx context.Context, key, owner string) error {
					at := strings.LastIndexByte(key, '/')
					i, _ := strconv.Atoi(key[at+1:])
					sem := fmt.Sprintf("%s/s%d", key[:at], i%1000)
					l, err := be.TryAcquirePermit(ctx, sqllock.PermitRequest{
						AcquireRequest: sqllock.AcquireRequest{Key: sem, TTL: time.Minute, Owner: owner}, Permits: n})
					if errors.Is(err, sqllock.ErrNotAcquired) {
						return nil
					}
					if err != nil {
						return err
					}
					return be.Release(ctx, l)
				}})
			}
			race(b, g, 2*g, 10_000, cs) // warm up connections and statement caches
			// Create every semaphore first: its first grant writes its N
			// permit rows and its limit row, which would otherwise be
			// most of what a short run measures.
			ctx := testCtx(b)
			for _, c := range cs[1:] {
				var wg sync.WaitGroup
				for w := range 8 {
					wg.Go(func() {
						for i := w; i < 1000; i += 8 {
							if err := c.run(ctx, fmt.Sprintf("%s/%d", c.name, i), fmt.Sprint("warm", i)); err != nil {
								b.Error(err)
								return
							}
						}
					})
				}
				wg.Wait()
			}
			for _, c := range cs {
				c.time = 0
			}
			b.ResetTimer()
			race(b, g, b.N, 10_000, cs)
			rate := func(c *contender) float64 { return float64(b.N) / c.time.Seconds() }
			b.ReportMetric(rate(single), "pairs/s")
			for _, c := range cs[1:] {
				b.ReportMetric(rate(c), c.name+"_pairs/s")
				b.ReportMetric(rate(single)/rate(c), c.name+"_ratio")
			}
		})
	}
}
