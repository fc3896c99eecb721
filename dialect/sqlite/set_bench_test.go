package sqlite

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// BenchmarkSetPair measures a set of 4 random keys (of 10,000) taken with
// TryAcquireAll and released, beside single-key TryAcquire + Release
// pairs through the same Backend, interleaved in rounds: set4 releases
// the set with one ReleaseAll (one statement, one commit), set4_each with
// one Release per lease sent at once (how a GuardSet released before
// ReleaseAll). Metrics: pairs/s of the single key, and for each set its
// pairs/s and ratio (the single key's rate over the set's: its cost in
// single-key pairs; target 1.5 for a set of 4):
//
//	go test -run '^$' -bench SetPair ./dialect/sqlite
func BenchmarkSetPair(b *testing.B) {
	for _, g := range []int{1, 4} {
		b.Run(fmt.Sprintf("goroutines=%d", g), func(b *testing.B) {
			be, _ := openTest(b, Options{})
			ctx := context.Background()
			const ttl = 30 * time.Second
			var owners atomic.Int64
			owner := func() string { return fmt.Sprint("o", owners.Add(1)) }
			type contender struct {
				name string
				run  func(key int) error
				time time.Duration
			}
			single := &contender{name: "key", run: func(key int) error {
				l, err := be.TryAcquire(ctx, sqllock.AcquireRequest{Key: fmt.Sprint("key/", key), TTL: ttl, Owner: owner()})
				if errors.Is(err, sqllock.ErrNotAcquired) {
					return nil // two goroutines drew the same key
				}
				if err != nil {
					return err
				}
				return be.Release(ctx, l)
			}}
			set := func(name string, release func([]sqllock.Lease) error) *contender {
				return &contender{name: name, run: func(key int) error {
					keys := make([]string, 4)
					for j := range keys {
						keys[j] = fmt.Sprintf("%s/%d", name, (key+j*2500)%benchKeys)
					}
					ls, err := be.TryAcquireAll(ctx, sqllock.MultiAcquireRequest{Keys: keys, TTL: ttl, Owner: owner()})
					if errors.Is(err, sqllock.ErrNotAcquired) {
						return nil
					}
					if err != nil {
						return err
					}
					return release(ls)
				}}
			}
			cs := []*contender{single,
				set("set4", func(ls []sqllock.Lease) error {
					answers, err := be.ReleaseAll(ctx, ls)
					if err != nil {
						return err
					}
					return errors.Join(answers...)
				}),
				set("set4_each", func(ls []sqllock.Lease) error {
					errs := make([]error, len(ls))
					var wg sync.WaitGroup
					for i, l := range ls {
						wg.Go(func() { errs[i] = be.Release(ctx, l) })
					}
					wg.Wait()
					return errors.Join(errs...)
				}),
			}
			race := func(n int) {
				for done := 0; done < n; {
					round := min(n-done, 25*g)
					for _, c := range cs {
						var next atomic.Int64
						var wg sync.WaitGroup
						start := time.Now()
						for range g {
							wg.Go(func() {
								for next.Add(1) <= int64(round) {
									if err := c.run(rand.N(benchKeys)); err != nil {
										b.Error(err)
										return
									}
								}
							})
						}
						wg.Wait()
						c.time += time.Since(start)
					}
					done += round
				}
			}
			race(2 * g) // warm up the statement caches
			for _, c := range cs {
				c.time = 0
			}
			b.ResetTimer()
			race(b.N)
			rate := func(c *contender) float64 { return float64(b.N) / c.time.Seconds() }
			b.ReportMetric(rate(single), "pairs/s")
			for _, c := range cs[1:] {
				b.ReportMetric(rate(c), c.name+"_pairs/s")
				b.ReportMetric(rate(single)/rate(c), c.name+"_ratio")
			}
		})
	}
}
