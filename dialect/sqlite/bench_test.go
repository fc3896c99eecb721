package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// BenchmarkPairs measures TryAcquire+Release pairs on random keys (10,000 of
// them) through the Backend and, interleaved in chunks in the same run, the
// same two statements sent raw through the same *sql.DB (prepared once, no
// validation, no write slot, no retry wrapper). It reports both rates and
// their ratio (target ≥ 0.9, docs/benchmark-targets.md):
//
//	go test -run '^$' -bench Pairs -count 6 ./dialect/sqlite
func BenchmarkPairs(b *testing.B) {
	for _, s := range []Synchronous{SynchronousFull, SynchronousNormal} {
		for _, g := range []int{1, 4} {
			b.Run(fmt.Sprintf("%s/goroutines=%d", s, g), func(b *testing.B) { benchPairs(b, s, g) })
		}
	}
}

const benchKeys = 10_000

func benchPairs(b *testing.B, s Synchronous, goroutines int) {
	be, _ := openTest(b, Options{Synchronous: s})
	ctx := context.Background()
	keys := make([]string, benchKeys)
	for i := range keys {
		keys[i] = "bench/" + strconv.Itoa(i)
	}
	const ttl = 30 * time.Second
	var owners atomic.Int64
	owner := func() string { return "o" + strconv.FormatInt(owners.Add(1), 10) }

	viaBackend := func() error {
		l, err := be.TryAcquire(ctx, sqllock.AcquireRequest{Key: keys[rand.N(benchKeys)], TTL: ttl, Owner: owner()})
		if errors.Is(err, sqllock.ErrNotAcquired) {
			return nil // two goroutines drew the same key
		}
		if err != nil {
			return err
		}
		return be.Release(ctx, l)
	}

	acq, err := be.db.PrepareContext(ctx, be.acquireSQL)
	if err != nil {
		b.Fatal(err)
	}
	defer acq.Close()
	rel, err := be.db.PrepareContext(ctx, be.releaseSQL)
	if err != nil {
		b.Fatal(err)
	}
	defer rel.Close()
	viaRaw := func() error {
		var (
			token, deadline, now int64
			held, kept           bool
			o                    string
			value                []byte
			shared               int
			waiting              string
		)
		key, me := keys[rand.N(benchKeys)], owner()
		if err := drainOne(acq.QueryContext(ctx, key, ttlMillis(ttl), me, nil, 0))(&token, &held, &deadline, &o, &value, &now, &kept, &shared, &waiting); err != nil {
			return err
		}
		if o != me {
			return nil
		}
		return drainOne(rel.QueryContext(ctx, key, token, me))(&deadline, &now)
	}

	const chunk = 16 // small: FULL pairs take ~1 ms and fsync latency drifts
	var tBackend, tRaw time.Duration
	b.ResetTimer()
	for done := 0; done < b.N; done += chunk {
		n := min(chunk, b.N-done)
		// Alternate which goes first, so neither always follows the other.
		if done/chunk%2 == 0 {
			tBackend += runSpread(b, goroutines, n, viaBackend)
			tRaw += runSpread(b, goroutines, n, viaRaw)
		} else {
			tRaw += runSpread(b, goroutines, n, viaRaw)
			tBackend += runSpread(b, goroutines, n, viaBackend)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(b.N)/tBackend.Seconds(), "pairs/s")
	b.ReportMetric(float64(b.N)/tRaw.Seconds(), "raw-pairs/s")
	b.ReportMetric(tRaw.Seconds()/tBackend.Seconds(), "ratio")
	b.ReportMetric(float64(be.Stats().BusyRetries), "busy-retries")
}

// drainOne reads at most one row into dest and the statement to its end.
func drainOne(rows *sql.Rows, err error) func(dest ...any) error {
	return func(dest ...any) error {
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			if err := rows.Scan(dest...); err != nil {
				return err
			}
		}
		return rows.Err()
	}
}

// runSpread runs fn n times on g goroutines and returns the elapsed time.
func runSpread(b *testing.B, g, n int, fn func() error) time.Duration {
	var (
		left atomic.Int64
		wg   sync.WaitGroup
		fail atomic.Pointer[error]
	)
	left.Store(int64(n))
	start := time.Now()
	for range g {
		wg.Go(func() {
			for left.Add(-1) >= 0 {
				if err := fn(); err != nil {
					fail.CompareAndSwap(nil, &err)
					return
				}
			}
		})
	}
	wg.Wait()
	d := time.Since(start)
	if err := fail.Load(); err != nil {
		b.Fatal(*err)
	}
	return d
}

// BenchmarkRefusedAcquire measures TryAcquire on a held key (what a waiter
// polls) at FULL: it commits nothing, so it costs no fsync and runs far
// faster than a granted pair.
func BenchmarkRefusedAcquire(b *testing.B) {
	be, _ := openTest(b, Options{})
	ctx := context.Background()
	if _, err := be.TryAcquire(ctx, sqllock.AcquireRequest{Key: "hot", TTL: time.Hour, Owner: "holder"}); err != nil {
		b.Fatal(err)
	}
	req := sqllock.AcquireRequest{Key: "hot", TTL: time.Minute, Owner: "waiter"}
	for b.Loop() {
		if _, err := be.TryAcquire(ctx, req); !errors.Is(err, sqllock.ErrNotAcquired) {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.N)/b.Elapsed().Seconds(), "refusals/s")
}

// BenchmarkRenewBatch measures one TryRenewBatch of n held leases: one write
// transaction, one fsync at synchronous=FULL. ns/op is the batch; the
// writer is held for about that long.
//
//	go test -run '^$' -bench RenewBatch ./dialect/sqlite
func BenchmarkRenewBatch(b *testing.B) {
	for _, n := range []int{1, 100, 1000} {
		b.Run(fmt.Sprintf("leases=%d", n), func(b *testing.B) {
			be, _ := openTest(b, Options{Synchronous: SynchronousFull})
			ctx := context.Background()
			reqs := make([]sqllock.RenewRequest, n)
			for i := range reqs {
				l, err := be.TryAcquire(ctx, sqllock.AcquireRequest{Key: fmt.Sprintf("batch/%05d", i), TTL: time.Minute, Owner: "o"})
				if err != nil {
					b.Fatal(err)
				}
				reqs[i] = sqllock.RenewRequest{Lease: l, TTL: time.Minute}
			}
			b.ReportAllocs()
			for b.Loop() {
				res, err := be.TryRenewBatch(ctx, reqs)
				if err != nil {
					b.Fatal(err)
				}
				for _, r := range res {
					if r.Err != nil {
						b.Fatal(r.Err)
					}
				}
			}
			b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/float64(n), "µs/lease")
		})
	}
}
