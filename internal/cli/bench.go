package cli

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/ashlock/ashlock/internal/lockbench"
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
	Workload  string  `json:"workload"`
	Database  string  `json:"database"`
	Clients   int     `json:"clients"`
	Keys      int     `json:"keys"`
	DurationS float64 `json:"duration_s"`
	Ops       int64   `json:"ops"`
	Unit      string  `json:"unit"`
	OpsPerSec float64 `json:"ops_per_sec"`
	P50MS     float64 `json:"p50_ms"`
	P99MS     float64 `json:"p99_ms"`
	P999MS    float64 `json:"p999_ms"`
	MaxMS     float64 `json:"max_ms"`
	// Busy counts the uncontended workload's attempts that found a key
	// held (by another bench on the same table, say).
	Busy       int64  `json:"busy,omitempty"`
	Errors     int64  `json:"errors"`
	FirstError string `json:"first_error,omitempty"`
}

type benchConfig struct {
	clients, keys int
	duration, ttl time.Duration
	owner         string
	workloads     []string
	asJSON        bool
}

func cmdBench(ctx context.Context, e *env, args []string) error {
	var (
		db  dbFlags
		cfg benchConfig
	)
	if err := e.parseBench(&db, &cfg, args); err != nil {
		return err
	}
	s, err := e.open(ctx, db, openOptions{maxConns: cfg.clients + 4})
	if err != nil {
		return err
	}
	defer s.close()
	// Fail early, with what to do, rather than count every operation as an
	// error: a missing table, a database that does not answer.
	if _, err := s.backend.List(ctx, benchPrefix); err != nil {
		return s.db.opError(err, db)
	}
	host, _ := os.Hostname()
	cfg.owner = fmt.Sprintf("sqllock-bench:%s:%d:%08x", host, os.Getpid(), rand.Uint32())
	if !cfg.asJSON {
		fmt.Fprintf(e.stdout, "sqllock bench: %s, table %s, %d clients, %v per workload, keys under %q\n",
			s.db, db.table, cfg.clients, cfg.duration, benchPrefix)
	}
	var results []benchResult
	for _, w := range cfg.workloads {
		r, err := benchWorkload(ctx, w, s.backend, cfg)
		if err != nil {
			return err
		}
		// Before anything else: an interrupt may leave a lease held.
		if err := sweep(ctx, s.backend, cfg); err != nil {
			return err
		}
		if ctx.Err() != nil {
			return fail(exitSignalBase+2, "interrupted during the %s workload", w)
		}
		r.Database = s.db.display
		r.FirstError = redact(r.FirstError)
		results = append(results, r)
	}
	return e.printBench(results, cfg.asJSON)
}

// parseBench parses and checks bench's flags; the table is bench's own
// unless --table names one.
func (e *env) parseBench(db *dbFlags, cfg *benchConfig, args []string) error {
	var workload string
	fs := e.flagSet("bench", benchUsage)
	fs.IntVar(&cfg.clients, "clients", 4, "concurrent `clients`")
	fs.IntVar(&cfg.keys, "keys", 1000, "number of `keys` of the uncontended workload (at least one per client)")
	durationVar(fs, &cfg.duration, "duration", 5*time.Second, "how long each workload runs")
	durationVar(fs, &cfg.ttl, "ttl", sqllock.DefaultTTL, "lease duration of every acquire")
	fs.StringVar(&workload, "workload", "all", "uncontended, hot, handoff or all")
	fs.BoolVar(&cfg.asJSON, "json", false, "print a JSON array instead of a table")
	if err := e.parseFlags(fs, db, noFlags{}, args); err != nil {
		return err
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
	switch workload {
	case "all":
		cfg.workloads = []string{"uncontended", "hot", "handoff"}
	case "uncontended", "hot", "handoff":
		cfg.workloads = []string{workload}
	default:
		return fail(ExitUsage, "--workload %q: want uncontended, hot, handoff or all", workload)
	}
	return nil
}

// printBench prints the results: a JSON array, or a table and the first
// error of each workload that had one.
func (e *env) printBench(results []benchResult, asJSON bool) error {
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

// benchWorkload runs the workload w.
func benchWorkload(ctx context.Context, w string, b sqllock.Backend, cfg benchConfig) (benchResult, error) {
	// The hard limit only matters if the database stops answering.
	ctx, cancel := context.WithTimeout(ctx, cfg.duration+time.Minute)
	defer cancel()
	switch w {
	case "uncontended":
		return benchUncontended(ctx, b, cfg), nil
	case "hot":
		return benchHot(ctx, b, cfg)
	}
	return benchHandoff(ctx, b, cfg)
}

// benchFigures is a workload's result as bench reports it.
func benchFigures(workload, unit string, cfg benchConfig, keys int, r lockbench.Result) benchResult {
	lat := r.Latency
	pct := func(q float64) float64 { return float64(lat.Quantile(q)) / float64(time.Millisecond) }
	res := benchResult{
		Workload: workload, Clients: cfg.clients, Keys: keys, DurationS: r.Elapsed.Seconds(),
		Ops: int64(r.Ops), Unit: unit, OpsPerSec: r.Rate(),
		P50MS: pct(0.50), P99MS: pct(0.99), P999MS: pct(0.999), MaxMS: pct(1),
		Errors: int64(r.Errors),
	}
	if r.FirstError != nil {
		res.FirstError = r.FirstError.Error()
	}
	return res
}

// ownerFor is the owner of a client's acquires: unique per acquire, and
// under this run's owner, which sweep looks for.
func (cfg benchConfig) ownerFor(client int) func() string {
	seq := 0
	return func() string {
		seq++
		return fmt.Sprintf("%s/c%d/%d", cfg.owner, client, seq)
	}
}

// benchUncontended: each client takes and releases random keys of its own.
func benchUncontended(ctx context.Context, b sqllock.Backend, cfg benchConfig) benchResult {
	keys := max(cfg.keys, cfg.clients)
	ops := make([]lockbench.Op, cfg.clients)
	for c := range ops {
		// Client c owns the keys i with i % clients == c.
		own := (keys - c + cfg.clients - 1) / cfg.clients
		key := func() string { return fmt.Sprintf("%suncontended/%d", benchPrefix, rand.N(own)*cfg.clients+c) }
		ops[c] = lockbench.Pair(b, key, cfg.ttl, cfg.ownerFor(c))
	}
	r := lockbench.Run(ctx, ops, cfg.duration, lockbench.RunOptions{Latency: true})
	res := benchFigures("uncontended", "pairs", cfg, keys, r)
	res.Busy = int64(r.Busy)
	return res
}

// benchHot: one lease holds a key; every client's TryAcquire is refused.
func benchHot(ctx context.Context, b sqllock.Backend, cfg benchConfig) (benchResult, error) {
	key := benchPrefix + "hot"
	holdTTL := min(cfg.duration+time.Minute+cfg.ttl, sqllock.MaxTTL)
	held, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: holdTTL, Owner: cfg.ownerFor(-1)()})
	if err != nil && !errors.Is(err, sqllock.ErrNotAcquired) {
		return benchResult{}, fmt.Errorf("hot workload: take %q: %w", key, err)
	}
	// (If another bench holds it, the attempts are refused all the same.)
	ops := make([]lockbench.Op, cfg.clients)
	for c := range ops {
		ops[c] = lockbench.Attempt(b, key, cfg.ttl, cfg.ownerFor(c))
	}
	r := lockbench.Run(ctx, ops, cfg.duration, lockbench.RunOptions{Latency: true, CountBusy: true})
	if held.Token > 0 {
		rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), releaseTimeout)
		defer cancel()
		if err := b.Release(rctx, held); err != nil {
			return benchResult{}, fmt.Errorf("hot workload: release %q: %w", key, err)
		}
	}
	return benchFigures("hot", "attempts", cfg, 1, r), nil
}

// benchHandoff: clients wait in Acquire on shared keys (two or more
// clients per key); each holder releases at once.
func benchHandoff(ctx context.Context, b sqllock.Backend, cfg benchConfig) (benchResult, error) {
	if cfg.clients < 2 {
		return benchResult{}, fail(ExitUsage, "the handoff workload needs --clients 2 or more")
	}
	keys := make([]string, max(1, min(cfg.keys, cfg.clients/2)))
	for i := range keys {
		keys[i] = fmt.Sprintf("%shandoff/%d", benchPrefix, i)
	}
	client, err := sqllock.New(b, sqllock.Options{Owner: cfg.owner, TTL: cfg.ttl, ReleaseTimeout: releaseTimeout})
	if err != nil {
		return benchResult{}, err
	}
	defer func() { _ = client.Close(context.Background()) }()
	h := lockbench.NewHandoff(client, keys, cfg.clients)
	r := lockbench.Run(ctx, h.Ops(), cfg.duration, lockbench.RunOptions{Over: h.Over})
	r.Latency = h.Latency()
	return benchFigures("handoff", "handoffs", cfg, len(keys), r), nil
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
