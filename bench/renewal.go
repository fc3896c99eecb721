package main

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// Renewal is the load of one process holding many leases.
type Renewal struct {
	Leases          int     `json:"leases"`
	TTLSeconds      float64 `json:"ttl_s"`
	RenewSeconds    float64 `json:"renew_interval_s"`
	WindowSeconds   float64 `json:"window_s"`
	AcquireSeconds  float64 `json:"acquire_s"`
	StatementsPerS  float64 `json:"statements_per_s"`   // pgx tracer: what the client sent
	XIDsPerS        float64 `json:"xids_per_s"`         // write transactions the server assigned
	XactCommitsPerS float64 `json:"xact_commits_per_s"` // pg_stat_database (flushed lazily: approximate)
	ClientCPUPct    float64 `json:"client_cpu_pct_of_one_core"`
	CPUusPerRenewal float64 `json:"client_cpu_us_per_renewal"`
	HeapKiBPerLease float64 `json:"heap_kib_per_lease"`
	Goroutines      int     `json:"goroutines"`
	Lost            int     `json:"lost"`
}

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

// renewal holds n leases with a 3 s TTL (the Guard renews every TTL/3 = 1 s)
// from one Client and measures, over a window, what the database sees and
// what CPU this process spends.
func (e *pgEnv) renewal(ctx context.Context, cfg *config) ([]Renewal, error) {
	const ttl = 3 * time.Second
	window := 6 * time.Second
	if cfg.quick {
		window = 3 * time.Second
	}
	var out []Renewal
	for _, n := range []int{1000, 10000} {
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
		var firstErr error
		var errMu sync.Mutex
		for range 32 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					i := int(next.Add(1)) - 1
					if i >= n {
						return
					}
					g, err := c.TryAcquire(ctx, fmt.Sprintf("renew-%05d", i), nil)
					if err != nil {
						errMu.Lock()
						firstErr = err
						errMu.Unlock()
						return
					}
					guards[i] = g
				}
			}()
		}
		wg.Wait()
		if firstErr != nil {
			c.Close(context.Background())
			return nil, fmt.Errorf("acquire %d leases: %w", n, firstErr)
		}
		acq := time.Since(t0)
		time.Sleep(1500 * time.Millisecond) // let renewals settle into their rhythm
		r := Renewal{Leases: n, TTLSeconds: ttl.Seconds(), RenewSeconds: (ttl / 3).Seconds(), AcquireSeconds: acq.Seconds()}
		r.HeapKiBPerLease = float64(int64(heapInuse())-int64(heap0)) / 1024 / float64(n)
		r.Goroutines = runtime.NumGoroutine() - g0
		st0, x0, xc0, cpu0, w0 := e.tracer.n.Load(), e.read(ctx).xids, e.xactCommits(ctx), rusageCPU(), time.Now()
		time.Sleep(window)
		st1, x1, xc1, cpu1, w1 := e.tracer.n.Load(), e.read(ctx).xids, e.xactCommits(ctx), rusageCPU(), time.Now()
		sec := w1.Sub(w0).Seconds()
		r.WindowSeconds = sec
		r.StatementsPerS = float64(st1-st0) / sec
		r.XIDsPerS = (x1 - x0) / sec
		r.XactCommitsPerS = (xc1 - xc0) / sec
		r.ClientCPUPct = 100 * (cpu1 - cpu0).Seconds() / sec
		if r.StatementsPerS > 0 {
			r.CPUusPerRenewal = us(cpu1-cpu0) / float64(st1-st0)
		}
		for _, g := range guards {
			if g.Err() != nil {
				r.Lost++
			}
		}
		logf("renewal %5d leases: %.0f statements/s (xids %.0f/s, xact_commit %.0f/s), client CPU %.1f%% of a core (%.0fµs/renewal), %.2f KiB heap/lease, lost %d; acquired in %.1fs",
			n, r.StatementsPerS, r.XIDsPerS, r.XactCommitsPerS, r.ClientCPUPct, r.CPUusPerRenewal, r.HeapKiBPerLease, r.Lost, r.AcquireSeconds)
		// Release them all, 32 at a time.
		next.Store(0)
		for range 32 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					i := int(next.Add(1)) - 1
					if i >= n {
						return
					}
					_ = guards[i].Release(ctx)
				}
			}()
		}
		wg.Wait()
		c.Close(ctx)
		out = append(out, r)
	}
	return out, nil
}
