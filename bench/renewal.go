package main

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ashlock/ashlock/sqllock"
)

// Renewal is the load of one process holding many leases.
type Renewal struct {
	Leases          int       `json:"leases"`
	Held            int       `json:"held"` // leases taken (acquiring stops after a bound)
	TTLSeconds      float64   `json:"ttl_s"`
	RenewSeconds    float64   `json:"renew_interval_s"`
	WindowSeconds   float64   `json:"window_s"`
	AcquireSeconds  float64   `json:"acquire_s"`
	StatementsPerS  float64   `json:"statements_per_s"`   // pgx tracer: what the client sent
	XIDsPerS        float64   `json:"xids_per_s"`         // write transactions the server assigned
	XactCommitsPerS float64   `json:"xact_commits_per_s"` // pg_stat_database (flushed lazily: approximate)
	ClientCPUPct    float64   `json:"client_cpu_pct_of_one_core"`
	CPUusPerRenewal float64   `json:"client_cpu_us_per_lease_renewal"` // per lease renewed, not per statement
	HeapKiBPerLease float64   `json:"heap_kib_per_lease"`
	Goroutines      int       `json:"goroutines"`
	PerSecond       []float64 `json:"statements_each_second"`
	Lost            int       `json:"lost"`           // held leases lost by the end of the window
	AcquireFailed   int       `json:"acquire_failed"` // acquires that failed while taking the leases
	ReleaseSeconds  float64   `json:"release_s"`      // releasing them all, from releaseGoroutines goroutines
	// NewConnsDuringRelease counts connections the pool opened while the
	// leases were released: growth to serve the releasing goroutines, or
	// replacements of connections it closed.
	NewConnsDuringRelease int64 `json:"new_conns_during_release"`
	// ClosedConnsDuringRelease counts connections the pool closed while
	// the leases were released (new ones minus its growth): a query
	// cancelled in flight costs pgx its connection.
	ClosedConnsDuringRelease int64 `json:"closed_conns_during_release"`
}

const releaseGoroutines = 512

func rusageCPU() time.Duration {
	var ru syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func heapInuse() uint64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return m.HeapInuse
}

func (e *pgEnv) xactCommits(ctx context.Context) float64 {
	e.adminMu.Lock()
	defer e.adminMu.Unlock()
	var v float64
	_ = e.admin.QueryRow(ctx, `SELECT (xact_commit + xact_rollback)::float8 FROM pg_stat_database WHERE datname = current_database()`).Scan(&v)
	return v
}

// renewal holds n leases with a TTL (renewed every TTL/3, in batches of the
// leases due together) from one Client and measures, over a window, what
// the database sees and what CPU this process spends.
func (e *pgEnv) renewal(ctx context.Context, cfg *config) ([]Renewal, error) {
	// Issue 14's targets: 10,000 leases at a 3 s TTL and 100,000 at a
	// 30 s TTL, each held by one client for 60 s with none lost.
	window := 60 * time.Second
	acquireFor := 120 * time.Second // stop taking more leases after this
	cases := []struct {
		n   int
		ttl time.Duration
	}{{1000, 3 * time.Second}, {10000, 3 * time.Second}, {100000, sqllock.DefaultTTL}}
	if cfg.quick {
		window, acquireFor = 3*time.Second, 15*time.Second
		cases = cases[:2]
	}
	var out []Renewal
	for _, cs := range cases {
		n, ttl := cs.n, cs.ttl
		interval := ttl / 3
		c, err := sqllock.New(e.backend, sqllock.Options{Owner: "renewal", TTL: ttl})
		if err != nil {
			return nil, err
		}
		heap0 := heapInuse()
		g0 := runtime.NumGoroutine()
		guards := make([]*sqllock.Guard, n)
		t0 := time.Now()
		var next atomic.Int64
		var wg sync.WaitGroup
		var failed atomic.Int64
		var firstErr error
		var errMu sync.Mutex
		for range 32 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					i := int(next.Add(1)) - 1
					if i >= n || time.Since(t0) > acquireFor {
						return
					}
					g, err := c.TryAcquire(ctx, fmt.Sprintf("renew-%05d", i), nil)
					if err != nil {
						// On an overloaded database an acquire's reply can
						// arrive after its own local deadline: counted, not
						// fatal.
						failed.Add(1)
						errMu.Lock()
						if firstErr == nil {
							firstErr = err
						}
						errMu.Unlock()
						if ctx.Err() != nil {
							return
						}
						continue
					}
					guards[i] = g
				}
			}()
		}
		wg.Wait()
		if ctx.Err() != nil {
			c.Close(context.Background())
			return nil, ctx.Err()
		}
		if firstErr != nil {
			logf("renewal %d leases: %d acquires failed, first: %v", n, failed.Load(), firstErr)
		}
		acq := time.Since(t0)
		// The window. Leases taken within [t0, t0+acq] renew at
		// [t0+k·interval, t0+k·interval+acq]. If acquiring took less than an
		// interval, a window starting 0.5 s after the last acquire and
		// lasting whole intervals holds exactly one renewal per lease per
		// interval, with 0.5 s to spare at both edges. Otherwise the
		// renewals are spread over the interval and any window will do
		// once they run.
		win := max(window, interval)
		if acq+500*time.Millisecond < interval {
			win = interval * time.Duration(max(1, (window+interval/2)/interval))
			time.Sleep(time.Until(t0.Add(acq + 500*time.Millisecond)))
		} else {
			time.Sleep(1500 * time.Millisecond)
		}
		r := Renewal{Leases: n, AcquireFailed: int(failed.Load()), TTLSeconds: ttl.Seconds(), RenewSeconds: interval.Seconds(), AcquireSeconds: acq.Seconds()}
		for _, g := range guards {
			if g != nil {
				r.Held++
			}
		}
		r.HeapKiBPerLease = float64(int64(heapInuse())-int64(heap0)) / 1024 / float64(n)
		r.Goroutines = runtime.NumGoroutine() - g0
		st0, x0, xc0, cpu0, w0 := e.tracer.n.Load(), e.read(ctx).xids, e.xactCommits(ctx), rusageCPU(), time.Now()
		// Statements per second through the window, to show its rhythm.
		stopTick := make(chan struct{})
		tickDone := make(chan struct{})
		go func() {
			defer close(tickDone)
			tk := time.NewTicker(time.Second)
			defer tk.Stop()
			last := e.tracer.n.Load()
			for {
				select {
				case <-stopTick:
					return
				case <-tk.C:
					cur := e.tracer.n.Load()
					r.PerSecond = append(r.PerSecond, float64(cur-last))
					last = cur
				}
			}
		}()
		time.Sleep(win - time.Since(w0))
		close(stopTick)
		<-tickDone
		st1, x1, xc1, cpu1, w1 := e.tracer.n.Load(), e.read(ctx).xids, e.xactCommits(ctx), rusageCPU(), time.Now()
		sec := w1.Sub(w0).Seconds()
		r.WindowSeconds = sec
		r.StatementsPerS = float64(st1-st0) / sec
		r.XIDsPerS = (x1 - x0) / sec
		r.XactCommitsPerS = (xc1 - xc0) / sec
		r.ClientCPUPct = 100 * (cpu1 - cpu0).Seconds() / sec
		if renewed := float64(r.Held) * sec / interval.Seconds(); renewed > 0 {
			r.CPUusPerRenewal = us(cpu1-cpu0) / renewed
		}
		for _, g := range guards {
			if g != nil && g.Err() != nil {
				r.Lost++
			}
		}
		logf("renewal %5d leases (%d held), TTL %v: %.0f statements/s (xids %.0f/s, xact_commit %.0f/s), client CPU %.1f%% of a core (%.0fµs/renewal), %.2f KiB heap/lease, lost %d; acquired in %.1fs",
			n, r.Held, ttl, r.StatementsPerS, r.XIDsPerS, r.XactCommitsPerS, r.ClientCPUPct, r.CPUusPerRenewal, r.HeapKiBPerLease, r.Lost, r.AcquireSeconds)
		// Release them all, from many goroutines, while their batches
		// keep renewing the leases not yet released: a release waits for
		// a batch in flight instead of cancelling it, so the pool opens
		// no connection.
		st := e.pool.Stat()
		conns0, total0, rt0 := st.NewConnsCount(), int64(st.TotalConns()), time.Now()
		next.Store(0)
		for range releaseGoroutines {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					i := int(next.Add(1)) - 1
					if i >= n {
						return
					}
					if guards[i] != nil {
						_ = guards[i].Release(ctx)
					}
				}
			}()
		}
		wg.Wait()
		r.ReleaseSeconds = time.Since(rt0).Seconds()
		st = e.pool.Stat()
		r.NewConnsDuringRelease = st.NewConnsCount() - conns0
		r.ClosedConnsDuringRelease = r.NewConnsDuringRelease - (int64(st.TotalConns()) - total0)
		logf("renewal %5d leases: statements each second of the window: %v", n, r.PerSecond)
		logf("renewal %5d leases: released %d in %.1fs; the pool opened %d new connections meanwhile and closed %d", n, r.Held, r.ReleaseSeconds, r.NewConnsDuringRelease, r.ClosedConnsDuringRelease)
		c.Close(ctx)
		out = append(out, r)
	}
	return out, nil
}

// BatchRenew is what one statement renewing many leases costs, measured
// with the raw table: the floor under the client's batch renewal.
type BatchRenew struct {
	Leases           int     `json:"leases"`
	MedianMs         float64 `json:"median_ms"`
	Reps             int     `json:"reps"`
	WALBytesPerLease float64 `json:"wal_bytes_per_lease"`
}

const batchRenewSQL = `
UPDATE raw_locks AS l SET deadline = clock_timestamp() + $3::bigint * interval '1 microsecond'
FROM unnest($1::text[], $2::bigint[]) AS r(key, token)
WHERE l.key = r.key AND l.token = r.token AND l.held AND l.deadline > clock_timestamp()`

func (e *pgEnv) batchRenew(ctx context.Context, cfg *config) ([]BatchRenew, error) {
	reps := 7
	if cfg.quick {
		reps = 3
	}
	var out []BatchRenew
	for _, n := range []int{1000, min(10000, len(e.keys))} {
		keys := e.keys[:n]
		if _, err := e.pool.Exec(ctx, `UPDATE raw_locks SET held = true, token = token + 1, deadline = clock_timestamp() + interval '1 hour' WHERE key = ANY($1)`, keys); err != nil {
			return nil, err
		}
		rows, err := e.pool.Query(ctx, `SELECT key, token FROM raw_locks WHERE key = ANY($1)`, keys)
		if err != nil {
			return nil, err
		}
		var ks []string
		var ts []int64
		var k string
		var t int64
		if _, err := pgx.ForEachRow(rows, []any{&k, &t}, func() error { ks = append(ks, k); ts = append(ts, t); return nil }); err != nil {
			return nil, err
		}
		var ds []time.Duration
		var wal []float64
		for range reps {
			c0 := e.read(ctx)
			t0 := time.Now()
			tag, err := e.pool.Exec(ctx, batchRenewSQL, ks, ts, micros(time.Hour))
			if err != nil {
				return nil, err
			}
			ds = append(ds, time.Since(t0))
			c1 := e.read(ctx)
			if tag.RowsAffected() != int64(n) {
				return nil, fmt.Errorf("batch renew: %d of %d rows", tag.RowsAffected(), n)
			}
			wal = append(wal, (c1.walBytes-c0.walBytes)/float64(n))
		}
		if _, err := e.pool.Exec(ctx, `UPDATE raw_locks SET held = false WHERE key = ANY($1)`, keys); err != nil {
			return nil, err
		}
		b := BatchRenew{Leases: n, Reps: reps, MedianMs: ms(durQuantile(ds, 0.5)), WALBytesPerLease: median(wal)}
		logf("batch renew of %d leases in one statement: median %.1f ms, %.0f WAL bytes/lease", n, b.MedianMs, b.WALBytesPerLease)
		out = append(out, b)
	}
	return out, nil
}
