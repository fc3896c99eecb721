package postgres

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// BenchmarkSetPair measures a set of 4 random keys (of 10,000) taken with
// TryAcquireAll and released, beside single-key TryAcquire + Release
// pairs through the same Backend, interleaved in rounds: set4 releases
// the set with one ReleaseAll (one statement), set4_each with one Release
// per lease sent at once (how a GuardSet released before ReleaseAll).
// Metrics: pairs/s of the single key, and for each set its pairs/s and
// ratio (the single key's rate over the set's: its cost in single-key
// pairs; target 1.5 for a set of 4). Run: SQLLOCK_REQUIRE_POSTGRES=1 go
// test -run '^$' -bench BenchmarkSetPair ./dialect/postgres
func BenchmarkSetPair(b *testing.B) {
	for _, g := range []int{1, 4, 16} {
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
			var relNs [2]atomic.Int64
			set := func(name string, n int, release func(context.Context, []sqllock.Lease) error) *contender {
				return &contender{name: name, run: func(ctx context.Context, key, owner string) error {
					ls, err := be.TryAcquireAll(ctx, sqllock.MultiAcquireRequest{Keys: setKeys(key), TTL: time.Minute, Owner: owner})
					if errors.Is(err, sqllock.ErrNotAcquired) {
						return nil
					}
					if err != nil {
						return err
					}
					start := time.Now()
					err = release(ctx, ls)
					relNs[n].Add(int64(time.Since(start)))
					return err
				}}
			}
			cs := []*contender{single,
				set("set4", 0, func(ctx context.Context, ls []sqllock.Lease) error { return releaseAll(ctx, be, ls) }),
				set("set4_each", 1, func(ctx context.Context, ls []sqllock.Lease) error { return releaseEach(ctx, be, ls) }),
			}
			race(b, g, 2*g, 10_000, cs) // warm up connections and statement caches
			for _, c := range cs {
				c.time = 0
			}
			relNs[0].Store(0)
			relNs[1].Store(0)
			b.ResetTimer()
			race(b, g, b.N, 10_000, cs)
			b.ReportMetric(float64(relNs[0].Load())/float64(b.N), "set4_release_ns")
			b.ReportMetric(float64(relNs[1].Load())/float64(b.N), "set4_each_release_ns")
			rate := func(c *contender) float64 { return float64(b.N) / c.time.Seconds() }
			b.ReportMetric(rate(single), "pairs/s")
			for _, c := range cs[1:] {
				b.ReportMetric(rate(c), c.name+"_pairs/s")
				b.ReportMetric(rate(single)/rate(c), c.name+"_ratio")
			}
		})
	}
}

// setKeys is the set of 4 keys the set benchmark takes for the random
// key "prefix/i": i and three more spread over the 10,000.
func setKeys(key string) []string {
	at := strings.LastIndexByte(key, '/')
	i, _ := strconv.Atoi(key[at+1:])
	keys := make([]string, 4)
	for j := range keys {
		keys[j] = fmt.Sprintf("%s/%d", key[:at], (i+j*2500)%10_000)
	}
	return keys
}

func releaseAll(ctx context.Context, mr sqllock.MultiReleaser, ls []sqllock.Lease) error {
	answers, err := mr.ReleaseAll(ctx, ls)
	if err != nil {
		return err
	}
	return errors.Join(answers...)
}

func releaseEach(ctx context.Context, be sqllock.Backend, ls []sqllock.Lease) error {
	errs := make([]error, len(ls))
	var wg sync.WaitGroup
	for i, l := range ls {
		wg.Go(func() { errs[i] = be.Release(ctx, l) })
	}
	wg.Wait()
	return errors.Join(errs...)
}
