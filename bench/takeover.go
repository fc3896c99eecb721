package main

import (
	"context"
	"fmt"
	"path/filepath"
	"time"

	"github.com/ashlock/ashlock/dialect/sqlite"
	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

// takeoverTTL is the crashed holder's lease.
const takeoverTTL = 300 * time.Millisecond

// oneTakeover: a holder takes key with a short lease and "crashes" (never
// renews or releases); a waiter calls Acquire shortly after. The sample is
// the new lease's grant time minus the old lease's deadline, both by the
// backend's clock.
func oneTakeover(ctx context.Context, b sqllock.Backend, waiter *sqllock.Client, key string) (time.Duration, error) {
	old, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: takeoverTTL, Owner: "crashed"})
	if err != nil {
		return 0, fmt.Errorf("holder: %w", err)
	}
	time.Sleep(30 * time.Millisecond)
	g, err := waiter.Acquire(ctx, key, &sqllock.AcquireOptions{Wait: 10 * time.Second})
	if err != nil {
		return 0, fmt.Errorf("waiter: %w", err)
	}
	defer g.Release(ctx)
	return g.Lease().BackendTime.Sub(old.Deadline), nil
}

func takeover(ctx context.Context, cfg *config, pe *pgEnv, tmp string) ([]Latency, error) {
	n := 20
	if cfg.quick {
		n = 6
	}
	type variant struct {
		name    string
		backend sqllock.Backend
		waiter  *sqllock.Client
		ds      []time.Duration
		errs    int
	}
	var vs []*variant
	if pe != nil {
		h, err := pe.side(ctx, "crashed", true)
		if err != nil {
			return nil, err
		}
		defer h.close()
		w, err := pe.side(ctx, "waiter", true)
		if err != nil {
			return nil, err
		}
		defer w.close()
		vs = append(vs, &variant{name: "PostgreSQL", backend: h.backend, waiter: w.client})
	}
	sb, err := sqlite.Open(filepath.Join(tmp, "takeover.db"), sqlite.Options{Synchronous: sqlite.SynchronousFull})
	if err != nil {
		return nil, err
	}
	defer sb.Close()
	sw, err := sqllock.New(sb, sqllock.Options{Owner: "waiter"})
	if err != nil {
		return nil, err
	}
	defer sw.Close(context.Background())
	vs = append(vs, &variant{name: "SQLite (FULL)", backend: sb, waiter: sw})
	mb := memory.New()
	mw, err := sqllock.New(mb, sqllock.Options{Owner: "waiter"})
	if err != nil {
		return nil, err
	}
	defer mw.Close(context.Background())
	vs = append(vs, &variant{name: "memory", backend: mb, waiter: mw})

	for i := range n {
		for k := range vs {
			v := vs[(k+i)%len(vs)]
			d, err := oneTakeover(ctx, v.backend, v.waiter, fmt.Sprintf("takeover-%d", i))
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			if err != nil {
				v.errs++
				logf("takeover %s: %v", v.name, err)
				continue
			}
			v.ds = append(v.ds, d)
		}
	}
	var out []Latency
	for _, v := range vs {
		l := newLatency("takeover", v.name, fmt.Sprintf("holder TTL %v, never renewed", takeoverTTL), v.ds, v.errs)
		logf("takeover %-14s n=%d p50 %.2fms p90 %.2fms p99 %.2fms max %.2fms", v.name, l.N, l.P50ms, l.P90ms, l.P99ms, l.MaxMs)
		out = append(out, l)
	}
	return out, nil
}
