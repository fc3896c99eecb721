package cli

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

const benchUsage = `
Usage: sqllock bench [--clients 4] [--keys 1000] [--duration 5s] [--workload all] [--json] [flags]

Load-tests the lock table of any database, as pgbench does for SQL: the
throughput, the latency percentiles (p50, p99, p99.9) and the errors of
three workloads, each run for --duration by --clients concurrent clients
(goroutines; on PostgreSQL each with its own pooled connection).

  uncontended  each client takes and releases random keys of its own
               (--keys in all): TryAcquire + Release pairs per second,
               the latency of a pair
  hot          one lease holds a single key for the whole run and every
               client hammers it with TryAcquire: refused attempts per
               second, the cost of polling a busy key
  handoff      clients wait in Acquire on shared keys (two or more clients
               per key); each holder releases at once: handoffs per second,
               and the latency from the start of a release to the moment a
               waiting client holds the key

It works in a lock table of its own, sqllock_bench, never in the table of
your real locks unless --table names it: it releases every lease it took,
but the rows stay (tokens must never reset, so a key's row is never
deleted; each run continues the tokens above the last). On SQLite the
table is created on first use; on PostgreSQL create it once with
  sqllock migrate up --table sqllock_bench
All keys start with "sqllock-bench/".

Examples:
  sqllock bench
  sqllock bench --database-url postgres://app@db/app --clients 16 --duration 10s --json
`

// benchTable is bench's own lock table, so that its rows (which can never
// be deleted) stay out of the table of real locks.
const benchTable = "sqllock_bench"

// benchPrefix starts every key bench uses.
const benchPrefix = "sqllock-bench/"

// benchResult is one workload's figures; the JSON names are stable.
type benchResult struct {
	Workload   string  `json:"workload"`
	Database   string  `json:"database"`
	Clients    int     `json:"clients"`
	Keys       int     `json:"keys"`
	DurationS  float64 `json:"duration_s"`
	Ops        int64   `json:"ops"`
	Unit       string  `json:"unit"`
	OpsPerSec  float64 `json:"ops_per_sec"`
	P50MS      float64 `json:"p50_ms"`
	P99MS      float64 `json:"p99_ms"`
	P999MS     float64 `json:"p999_ms"`
	MaxMS      float64 `json:"max_ms"`
	Errors     int64   `json:"errors"`
	FirstError string  `json:"first_error,omitempty"`
}

type benchConfig struct {
	clients, keys int
	duration, ttl time.Duration
	owner         string
}

func cmdBench(ctx context.Context, e *env, args []string) error {
	var (
		db       dbFlags
		cfg      benchConfig
		workload string
		asJSON   bool
	)
	fs := e.flagSet("bench", benchUsage)
	fs.IntVar(&cfg.clients, "clients", 4, "concurrent `clients`")
	fs.IntVar(&cfg.keys, "keys", 1000, "number of `keys` of the uncontended workload (at least one per client)")
	durationVar(fs, &cfg.duration, "duration", 5*time.Second, "how long each workload runs")
	durationVar(fs, &cfg.ttl, "ttl", sqllock.DefaultTTL, "lease duration of every acquire")
	fs.StringVar(&workload, "workload", "all", "uncontended, hot, handoff or all")
	fs.BoolVar(&asJSON, "json", false, "print a JSON array instead of a table")
	db.register(fs)
	fs.Lookup("table").Usage = "lock `table` to bench in (default " + benchTable + ": its own, never the table of your real locks unless named here)"
	if err := e.parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fail(ExitUsage, "unexpected argument %q (see sqllock bench --help)", fs.Arg(0))
	}
	db.table = cmp.Or(db.table, benchTable)
	switch {
	case cfg.clients < 1 || cfg.clients > 10000:
		return fail(ExitUsage, "--clients %d: want 1 to 10000", cfg.clients)
	case cfg.keys < 1:
		return fail(ExitUsage, "--keys %d: want at least 1", cfg.keys)
	case cfg.duration <= 0:
		return fail(ExitUsage, "--duration %v: want a positive duration", cfg.duration)
	}
	if err := checkTTL(cfg.ttl, sqllock.MinTTL, sqllock.MaxTTL); err != nil {
		return err
	}
	var workloads []string
	switch workload {
	case "all":
		workloads = []string{"uncontended", "hot", "handoff"}
	case "uncontended", "hot", "handoff":
		workloads = []string{workload}
	default:
		return fail(ExitUsage, "--workload %q: want uncontended, hot, handoff or all", workload)
	}
	d, err := e.database(db)
	if err != nil {
		return err
	}
	b, err := e.openBackend(ctx, d, db, cfg.clients+4)
	if err != nil {
		return err
	}
	defer b.close()
	// Fail early, with what to do, rather than count every operation as an
	// error: a missing table, a database that does not answer.
	if _, err := b.List(ctx, benchPrefix); err != nil {
		return d.opError(err, db)
	}
	host, _ := os.Hostname()
	cfg.owner = fmt.Sprintf("sqllock-bench:%s:%d:%08x", host, os.Getpid(), rand.Uint32())

	if !asJSON {
		fmt.Fprintf(e.stdout, "sqllock bench: %s, table %s, %d clients, %v per workload, keys under %q\n",
			d, db.table, cfg.clients, cfg.duration, benchPrefix)
	}
	var results []benchResult
	for _, w := range workloads {
		var r benchResult
		switch w {
		case "uncontended":
			r, err = benchUncontended(ctx, b, cfg)
		case "hot":
			r, err = benchHot(ctx, b, cfg)
		case "handoff":
			r, err = benchHandoff(ctx, b, cfg)
		}
		if err != nil {
			return err
		}
		if ctx.Err() != nil {
			return fail(exitSignalBase+2, "interrupted during the %s workload", w)
		}
		if err := sweep(ctx, b, cfg); err != nil {
			return err
		}
		r.Database = d.display
		r.FirstError = redact(r.FirstError)
		results = append(results, r)
	}
	if asJSON {
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(results)
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "workload\tclients\tkeys\tops\trate\tp50\tp99\tp99.9\tmax\terrors\t")
	for _, r := range results {
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%.0f %s/s\t%s\t%s\t%s\t%s\t%d\t\n", r.Workload, r.Clients, r.Keys, r.Ops,
			r.OpsPerSec, r.Unit, ms(r.P50MS), ms(r.P99MS), ms(r.P999MS), ms(r.MaxMS), r.Errors)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	for _, r := range results {
		if r.FirstError != "" {
			fmt.Fprintf(e.stdout, "%s: first error: %s\n", r.Workload, r.FirstError)
		}
	}
	fmt.Fprintln(e.stdout, "The bench rows stay in the table (tokens never reset); every lease was released.")
	return nil
}

func ms(v float64) string { return fmt.Sprintf("%.2fms", v) }

// recorder collects one workload's latencies and errors from all clients.
type recorder struct {
	mu         sync.Mutex
	lat        []time.Duration
	errors     int64
	firstError error
}

// worker is one client's share, merged into the recorder once at the end.
type worker struct {
	lat    []time.Duration
	errors int64
	first  error
}

func (w *worker) fail(err error) {
	w.errors++
	if w.first == nil {
		w.first = err
	}
}

func (r *recorder) merge(w *worker) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.lat = append(r.lat, w.lat...)
	r.errors += w.errors
	if r.firstError == nil {
		r.firstError = w.first
	}
}

func (r *recorder) result(workload, unit string, cfg benchConfig, keys int, elapsed time.Duration) benchResult {
	slices.Sort(r.lat)
	pct := func(q float64) float64 {
		if len(r.lat) == 0 {
			return 0
		}
		return float64(r.lat[int(q*float64(len(r.lat)-1))]) / float64(time.Millisecond)
	}
	res := benchResult{
		Workload: workload, Clients: cfg.clients, Keys: keys, DurationS: elapsed.Seconds(),
		Ops: int64(len(r.lat)), Unit: unit, OpsPerSec: float64(len(r.lat)) / elapsed.Seconds(),
		P50MS: pct(0.50), P99MS: pct(0.99), P999MS: pct(0.999), MaxMS: pct(1),
		Errors: r.errors,
	}
	if r.firstError != nil {
		res.FirstError = r.firstError.Error()
	}
	return res
}

// run is one workload's run: clients stop between operations once it is
// over, so that no statement is cut off by the end of the run (a cut-off
// acquire may be granted without the client learning it).
type run struct {
	ctx  context.Context // ends only on an interrupt, or long after the run
	stop <-chan struct{} // closed when the duration has passed
	end  time.Time
}

// over reports whether the run has ended.
func (r *run) over() bool {
	select {
	case <-r.stop:
		return true
	default:
		return r.ctx.Err() != nil
	}
}

// record adds an operation's latency if it completed within the run.
func (r *run) record(w *worker, start time.Time) {
	if now := time.Now(); now.Before(r.end) {
		w.lat = append(w.lat, now.Sub(start))
	}
}

// runClients runs fn on cfg.clients goroutines until the duration passes or
// ctx ends, and returns the time measured.
func runClients(ctx context.Context, cfg benchConfig, rec *recorder, fn func(r *run, client int, w *worker)) time.Duration {
	// The hard limit only matters if the database stops answering.
	ctx, cancel := context.WithTimeout(ctx, cfg.duration+time.Minute)
	defer cancel()
	start := time.Now()
	stop := make(chan struct{})
	timer := time.AfterFunc(cfg.duration, func() { close(stop) })
	defer timer.Stop()
	r := &run{ctx: ctx, stop: stop, end: start.Add(cfg.duration)}
	var wg sync.WaitGroup
	for c := range cfg.clients {
		wg.Go(func() {
			var w worker
			fn(r, c, &w)
			rec.merge(&w)
		})
	}
	wg.Wait()
	return min(time.Since(start), cfg.duration)
}

func (cfg benchConfig) ownerFor(client int, seq int) string {
	return fmt.Sprintf("%s/c%d/%d", cfg.owner, client, seq)
}

// runEnded reports whether err is the end of the run (an interrupt) rather
// than a failure.
func runEnded(ctx context.Context, err error) bool {
	return ctx.Err() != nil && (errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) ||
		errors.Is(err, sqllock.ErrIndeterminate) || errors.Is(err, sqllock.ErrUnavailable))
}

// benchUncontended: each client takes and releases random keys of its own.
func benchUncontended(ctx context.Context, b sqllock.Backend, cfg benchConfig) (benchResult, error) {
	keys := max(cfg.keys, cfg.clients)
	rec := &recorder{}
	elapsed := runClients(ctx, cfg, rec, func(r *run, c int, w *worker) {
		// Client c owns the keys i with i % clients == c.
		own := (keys - c + cfg.clients - 1) / cfg.clients
		for seq := 1; !r.over(); seq++ {
			key := fmt.Sprintf("%suncontended/%d", benchPrefix, rand.N(own)*cfg.clients+c)
			start := time.Now()
			l, err := b.TryAcquire(r.ctx, sqllock.AcquireRequest{Key: key, TTL: cfg.ttl, Owner: cfg.ownerFor(c, seq)})
			if err != nil {
				if !runEnded(r.ctx, err) {
					w.fail(err)
				}
				continue
			}
			// Release even when interrupted, so no lease is left.
			if err := b.Release(context.WithoutCancel(r.ctx), l); err != nil {
				w.fail(err)
				continue
			}
			r.record(w, start)
		}
	})
	return rec.result("uncontended", "pairs", cfg, keys, elapsed), nil
}

// benchHot: one lease holds a key; every client's TryAcquire is refused.
func benchHot(ctx context.Context, b sqllock.Backend, cfg benchConfig) (benchResult, error) {
	key := benchPrefix + "hot"
	holdTTL := min(cfg.duration+time.Minute+cfg.ttl, sqllock.MaxTTL)
	held, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: holdTTL, Owner: cfg.ownerFor(-1, 0)})
	if err != nil && !errors.Is(err, sqllock.ErrNotAcquired) {
		return benchResult{}, fmt.Errorf("hot workload: take %q: %w", key, err)
	}
	// (If another bench holds it, the attempts are refused all the same.)
	rec := &recorder{}
	elapsed := runClients(ctx, cfg, rec, func(r *run, c int, w *worker) {
		for seq := 1; !r.over(); seq++ {
			start := time.Now()
			l, err := b.TryAcquire(r.ctx, sqllock.AcquireRequest{Key: key, TTL: cfg.ttl, Owner: cfg.ownerFor(c, seq)})
			switch {
			case err == nil:
				// The holder's lease ended early: give it back.
				_ = b.Release(context.WithoutCancel(r.ctx), l)
				w.fail(fmt.Errorf("acquired %q, which should have been held", key))
			case errors.Is(err, sqllock.ErrNotAcquired):
				r.record(w, start)
			case !runEnded(r.ctx, err):
				w.fail(err)
			}
		}
	})
	if held.Token > 0 {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
		defer cancel()
		if err := b.Release(rctx, held); err != nil {
			return benchResult{}, fmt.Errorf("hot workload: release %q: %w", key, err)
		}
	}
	return rec.result("hot", "attempts", cfg, 1, elapsed), nil
}

// handoffKey is the shared state of one key of the handoff workload.
type handoffKey struct {
	mu         sync.Mutex
	releasedAt time.Time     // when the last holder started its release
	releaser   int           // which client that was
	acquired   chan struct{} // closed at the next acquisition
}

// benchHandoff: clients wait in Acquire; each holder releases at once and
// then waits for another client to take the key before it queues again.
func benchHandoff(ctx context.Context, b sqllock.Backend, cfg benchConfig) (benchResult, error) {
	if cfg.clients < 2 {
		return benchResult{}, fail(ExitUsage, "the handoff workload needs --clients 2 or more")
	}
	nkeys := max(1, min(cfg.keys, cfg.clients/2))
	states := make([]*handoffKey, nkeys)
	for i := range states {
		states[i] = &handoffKey{releaser: -1, acquired: make(chan struct{})}
	}
	client, err := sqllock.New(b, sqllock.Options{Owner: cfg.owner, TTL: cfg.ttl, ReleaseTimeout: releaseTimeout})
	if err != nil {
		return benchResult{}, err
	}
	defer func() { _ = client.Close(context.Background()) }()
	rec := &recorder{}
	elapsed := runClients(ctx, cfg, rec, func(r *run, c int, w *worker) {
		k := c % nkeys
		st, key := states[k], fmt.Sprintf("%shandoff/%d", benchPrefix, k)
		for !r.over() {
			// Not cancelled at the end of the run: every waiter gets the
			// key in turn, as each holder releases it, and then stops.
			g, err := client.Acquire(r.ctx, key, &sqllock.AcquireOptions{Wait: sqllock.WaitForever})
			if err != nil {
				if !runEnded(r.ctx, err) {
					w.fail(err)
				}
				continue
			}
			now := time.Now()
			st.mu.Lock()
			if st.releaser >= 0 && st.releaser != c && now.Before(r.end) {
				w.lat = append(w.lat, now.Sub(st.releasedAt))
			}
			close(st.acquired)
			st.acquired = make(chan struct{})
			next := st.acquired
			st.releasedAt, st.releaser = time.Now(), c
			st.mu.Unlock()
			if err := g.Release(context.WithoutCancel(r.ctx)); err != nil {
				w.fail(err)
			}
			select { // let a waiter have it before queueing again
			case <-next:
			case <-r.stop:
			case <-r.ctx.Done():
			}
		}
	})
	return rec.result("handoff", "handoffs", cfg, nkeys, elapsed), nil
}

// sweep releases every bench lease of this run that is still held. An
// acquire cut off by the end of the run can be granted without the client
// learning it (its outcome is indeterminate); such a lease would otherwise
// hold its key until the TTL passes. The release is token-scoped, and only
// leases whose owner is this run's are touched.
func sweep(ctx context.Context, b sqllock.Backend, cfg benchConfig) error {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
	defer cancel()
	infos, err := b.List(ctx, benchPrefix)
	if err != nil {
		return fmt.Errorf("release the bench's leases: %w", err)
	}
	for _, in := range infos {
		if !in.Held || !strings.HasPrefix(in.Owner, cfg.owner+"/") {
			continue
		}
		err := b.Release(ctx, sqllock.Lease{Key: in.Key, Token: in.Token, Owner: in.Owner})
		if err != nil && !errors.Is(err, sqllock.ErrLeaseLost) {
			return fmt.Errorf("release the bench's lease on %q: %w", in.Key, err)
		}
	}
	return nil
}
