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
// Backend on random keys of 10,000, one goroutine: plain (exclusive,
// one-shot), marked (a waiting writer's exclusive request, acquire_mark)
// and shared (shared_acquire + shared_release), at synchronous=FULL (the
// default: an fsync per commit) and NORMAL (no fsync: the statements' own
// cost). The three run in alternating chunks on one Backend, so that the
// ratios (each pair's time over the plain pair's: marked_ratio,
// shared_ratio) compare like with like on a machine whose speed drifts.
// The target: both within 1.2x (docs/shared-locks.md):
//
//	go test -run '^$' -bench SharedPairs -benchtime 3000x -count 4 ./dialect/sqlite
func BenchmarkSharedPairs(b *testing.B) {
	for _, s := range []Synchronous{SynchronousFull, SynchronousNormal} {
		b.Run(string(s), func(b *testing.B) {
			be, _ := openTest(b, Options{Synchronous: s})
			ctx := context.Background()
			var owners atomic.Int64
			pair := func(mark, shared bool) func() error {
				return func() error {
					req := sqllock.AcquireRequest{Key: "bench/" + strconv.Itoa(rand.N(benchKeys)), TTL: 30 * time.Second,
						Owner: "o" + strconv.FormatInt(owners.Add(1), 10), Mark: mark, Shared: shared}
					l, err := be.TryAcquire(ctx, req)
					if errors.Is(err, sqllock.ErrNotAcquired) {
						return nil
					}
					if err != nil {
						return err
					}
					return be.Release(ctx, l)
				}
			}
			modes := []func() error{pair(false, false), pair(true, false), pair(false, true)}
			var took [3]time.Duration
			const chunk = 16
			b.ResetTimer()
			for done := 0; done < b.N; done += chunk {
				n := min(chunk, b.N-done)
				// Each chunk starts with the next mode, so none always
				// follows another.
				for j := range modes {
					m := (done/chunk + j) % len(modes)
					took[m] += runSpread(b, 1, n, modes[m])
				}
			}
			b.StopTimer()
			b.ReportMetric(float64(b.N)/took[0].Seconds(), "plain-pairs/s")
			b.ReportMetric(float64(b.N)/took[2].Seconds(), "shared-pairs/s")
			b.ReportMetric(took[1].Seconds()/took[0].Seconds(), "marked_ratio")
			b.ReportMetric(took[2].Seconds()/took[0].Seconds(), "shared_ratio")
		})
	}
}
