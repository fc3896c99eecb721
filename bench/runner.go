package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"slices"
	"time"

	"github.com/ashlock/ashlock/internal/lockbench"
)

// pairFunc makes one attempt: acquire and, when granted, release. It reports
// whether it held the lock (false: the key was busy).
type pairFunc = lockbench.Op

// contender is one way of taking locks. newWorker builds the per-goroutine
// state (its random source, owner name, connection...).
type contender struct {
	name      string
	newWorker func(id int, rng *rand.Rand) pairFunc
}

// probe reads counters around a cell (WAL position, transaction ids,
// statements sent); nil when not applicable.
type probe interface {
	read(ctx context.Context) counters
}

type counters struct {
	walBytes   float64 // pg_current_wal_insert_lsn() in bytes
	xids       float64 // next transaction id
	statements float64 // statements sent through the pgx pools
	ok         bool
	// cost holds further counters by name, reported per operation (the
	// etcd probe's: requests the server received, raft entries, CPU).
	cost map[string]float64
}

// sub is the change from b to a: the fields, and each cost counter both
// readings have.
func (a counters) sub(b counters) counters {
	d := counters{walBytes: a.walBytes - b.walBytes, xids: a.xids - b.xids, statements: a.statements - b.statements, ok: true}
	for k, v := range a.cost {
		if bv, ok := b.cost[k]; ok {
			if d.cost == nil {
				d.cost = map[string]float64{}
			}
			d.cost[k] = v - bv
		}
	}
	return d
}

// cellRun is one contender at one concurrency in one round.
type cellRun struct {
	ops      uint64 // successful pairs (or attempts, for hot-key cells)
	busy     uint64
	errs     uint64
	firstErr error
	elapsed  time.Duration
	lat      *lockbench.Hist
	mallocs  uint64
	delta    counters
	// costGaps counts the slices of an accumulated cell without cost
	// counters: a round with any is left out of the cost figures.
	costGaps int
}

func (r cellRun) rate() float64 { return float64(r.ops) / r.elapsed.Seconds() }

// runCell runs c with g goroutines for d. countBusy counts busy attempts as
// operations (hot-key cells measure failed attempts).
func runCell(ctx context.Context, c contender, g int, d time.Duration, seed uint64, pr probe, recordLatency, countBusy bool) cellRun {
	workers := make([]pairFunc, g)
	for i := range workers {
		workers[i] = c.newWorker(i, rand.New(rand.NewPCG(seed, uint64(i)*0x9e3779b97f4a7c15+1)))
	}
	var before, after counters
	var ms0, ms1 runtime.MemStats
	res := lockbench.Run(ctx, workers, d, lockbench.RunOptions{
		Latency: recordLatency, CountBusy: countBusy,
		Started: func() {
			if pr != nil {
				before = pr.read(ctx)
			}
			runtime.ReadMemStats(&ms0)
		},
		Stopped: func() {
			runtime.ReadMemStats(&ms1)
			if pr != nil {
				after = pr.read(ctx)
			}
		},
	})
	r := cellRun{ops: res.Ops, busy: res.Busy, errs: res.Errors, firstErr: res.FirstError, elapsed: res.Elapsed, mallocs: ms1.Mallocs - ms0.Mallocs, lat: res.Latency}
	if before.ok && after.ok || before.cost != nil && after.cost != nil {
		r.delta = after.sub(before)
		r.delta.ok = before.ok && after.ok // the PostgreSQL fields
	}
	return r
}

// Cell is the result of one contender at one concurrency over all rounds.
type Cell struct {
	Section    string    `json:"section"`
	Contender  string    `json:"contender"`
	Goroutines int       `json:"goroutines"`
	PerRound   []float64 `json:"ops_per_sec_per_round"`
	OpsPerSec  float64   `json:"ops_per_sec_median"`
	P50us      float64   `json:"p50_us,omitempty"`
	P99us      float64   `json:"p99_us,omitempty"`
	// Per operation, medians over rounds (PostgreSQL cells only).
	WALBytesPerOp   *float64 `json:"wal_bytes_per_op,omitempty"`
	XIDsPerOp       *float64 `json:"xids_per_op,omitempty"`
	StatementsPerOp *float64 `json:"pgx_statements_per_op,omitempty"`
	AllocsPerOp     *float64 `json:"allocs_per_op,omitempty"`
	// Cost per operation by counter name, medians over rounds (etcd
	// cells: see etcdProbe).
	CostPerOp  map[string]float64 `json:"cost_per_op,omitempty"`
	Busy       uint64             `json:"busy_attempts,omitempty"`
	Errors     uint64             `json:"errors,omitempty"`
	FirstError string             `json:"first_error,omitempty"`
}

// matrix runs contenders × concurrencies for a number of rounds,
// interleaved: each round runs every cell once, the contenders in an order
// rotated by the round, so that drift on a noisy machine hits them alike.
type matrix struct {
	section       string
	contenders    []contender
	conc          []int
	rounds        int
	dur           time.Duration
	probe         probe
	latency       bool
	countBusy     bool
	allocs        bool
	statementsPer bool // the probe's statement count is meaningful for these contenders
	noStatements  map[string]bool
	warmup        time.Duration

	runs map[string]map[int][]cellRun // contender → goroutines → rounds
}

func (m *matrix) run(ctx context.Context, logf func(string, ...any)) error {
	m.runs = map[string]map[int][]cellRun{}
	for _, c := range m.contenders {
		m.runs[c.name] = map[int][]cellRun{}
	}
	// Warm-up, discarded: opens every pool's connections and prepares the
	// statements, so that the first measured cell pays for neither.
	if m.warmup > 0 {
		for _, c := range m.contenders {
			runCell(ctx, c, slices.Max(m.conc), m.warmup, 7, nil, false, m.countBusy)
		}
	}
	// A round's cell is made of short slices, interleaved with the other
	// contenders' slices: the noise of a shared machine comes and goes
	// within seconds, and each contender should see as much of it as the
	// others.
	slices := max(1, int((m.dur+sliceLen/2)/sliceLen))
	n := len(m.contenders)
	for r := 0; r < m.rounds; r++ {
		for _, g := range m.conc {
			agg := make([]cellRun, n)
			for s := range slices {
				for k := range n {
					i := (k + r + s) % n
					if err := ctx.Err(); err != nil {
						return err
					}
					res := runCell(ctx, m.contenders[i], g, m.dur/time.Duration(slices), uint64(r*1_000_000+s*1000+g), m.probe, m.latency, m.countBusy)
					agg[i].add(res)
				}
			}
			for i, c := range m.contenders {
				res := agg[i]
				m.runs[c.name][g] = append(m.runs[c.name][g], res)
				msg := fmt.Sprintf("%s r%d g=%-3d %-34s %10.0f/s", m.section, r+1, g, c.name, res.rate())
				if res.lat != nil {
					msg += fmt.Sprintf("  p50 %7.0fµs p99 %7.0fµs", us(res.lat.Quantile(0.5)), us(res.lat.Quantile(0.99)))
				}
				if res.errs > 0 {
					msg += fmt.Sprintf("  errors %d (%v)", res.errs, res.firstErr)
				}
				logf("%s", msg)
			}
		}
	}
	return nil
}

// sliceLen is the target length of one slice of a cell.
const sliceLen = 250 * time.Millisecond

// add accumulates slice o into r.
func (r *cellRun) add(o cellRun) {
	r.ops += o.ops
	r.busy += o.busy
	r.errs += o.errs
	if r.firstErr == nil {
		r.firstErr = o.firstErr
	}
	r.elapsed += o.elapsed
	r.mallocs += o.mallocs
	if o.lat != nil {
		if r.lat == nil {
			r.lat = new(lockbench.Hist)
		}
		r.lat.Merge(o.lat)
	}
	if o.delta.ok {
		r.delta.walBytes += o.delta.walBytes
		r.delta.xids += o.delta.xids
		r.delta.statements += o.delta.statements
		r.delta.ok = true
	}
	r.costGaps += o.costGaps
	if o.delta.cost == nil {
		r.costGaps++
	}
	for k, v := range o.delta.cost {
		if r.delta.cost == nil {
			r.delta.cost = map[string]float64{}
		}
		r.delta.cost[k] += v
	}
}

func (m *matrix) cells() []Cell {
	var out []Cell
	for _, c := range m.contenders {
		for _, g := range m.conc {
			runs := m.runs[c.name][g]
			if len(runs) == 0 {
				continue
			}
			cell := Cell{Section: m.section, Contender: c.name, Goroutines: g}
			var wal, xid, st, al []float64
			cost := map[string][]float64{}
			lat := new(lockbench.Hist)
			for _, r := range runs {
				cell.PerRound = append(cell.PerRound, r.rate())
				cell.Busy += r.busy
				cell.Errors += r.errs
				if r.firstErr != nil && cell.FirstError == "" {
					cell.FirstError = r.firstErr.Error()
				}
				if r.lat != nil {
					lat.Merge(r.lat)
				}
				if r.ops > 0 {
					al = append(al, float64(r.mallocs)/float64(r.ops))
					if r.delta.ok {
						wal = append(wal, r.delta.walBytes/float64(r.ops))
						xid = append(xid, r.delta.xids/float64(r.ops))
						st = append(st, r.delta.statements/float64(r.ops))
					}
					if r.costGaps == 0 {
						for k, v := range r.delta.cost {
							cost[k] = append(cost[k], v/float64(r.ops))
						}
					}
				}
			}
			cell.OpsPerSec = median(cell.PerRound)
			if lat.N() > 0 {
				cell.P50us = us(lat.Quantile(0.5))
				cell.P99us = us(lat.Quantile(0.99))
			}
			if len(wal) > 0 {
				w, x := median(wal), median(xid)
				cell.WALBytesPerOp, cell.XIDsPerOp = &w, &x
				if m.statementsPer && !m.noStatements[c.name] {
					s := median(st)
					cell.StatementsPerOp = &s
				}
			}
			for k, xs := range cost {
				if len(xs) == len(runs) { // every round measured it
					if cell.CostPerOp == nil {
						cell.CostPerOp = map[string]float64{}
					}
					cell.CostPerOp[k] = median(xs)
				}
			}
			if m.allocs && len(al) > 0 {
				a := median(al)
				cell.AllocsPerOp = &a
			}
			out = append(out, cell)
		}
	}
	return out
}

// ratio is the median over rounds of a's rate divided by b's rate in the
// same round, at g goroutines: the interleaved comparison.
func (m *matrix) ratio(a, b string, g int) float64 {
	ra, rb := m.runs[a][g], m.runs[b][g]
	var xs []float64
	for i := range min(len(ra), len(rb)) {
		if rb[i].rate() > 0 {
			xs = append(xs, ra[i].rate()/rb[i].rate())
		}
	}
	return median(xs)
}

// Ratio is one interleaved comparison, for the JSON file.
type Ratio struct {
	Section    string  `json:"section"`
	A          string  `json:"a"`
	B          string  `json:"b"`
	Goroutines int     `json:"goroutines"`
	AOverB     float64 `json:"a_over_b_median_of_rounds"`
}
