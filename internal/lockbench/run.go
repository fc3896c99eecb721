// Package lockbench is the measurement that both of ashlock's benchmarks
// make: `sqllock bench`, which an operator runs against their own
// database, and the bench module, which runs the same workloads beside
// other locks and raw statements. It holds the operations they repeat on
// ashlock (Pair, ClientPair, Attempt, and the queue of waiters of
// Handoff, which only the CLI runs: bench's handoff section times single
// wake-ups against other locks), the loop that runs operations on
// concurrent workers for a duration (Run), and the latency histogram
// (Hist), so that a figure of one means what the same figure of the other
// means.
package lockbench

import (
	"context"
	"sync"
	"sync/atomic"
	"time"
)

// Op is one operation of a worker: an acquire and, when granted, a
// release, or a single attempt. It reports whether it held the lock
// (false: the key was busy). A worker's Op is called by one goroutine
// only.
type Op func(ctx context.Context) (held bool, err error)

// RunOptions say what Run records.
type RunOptions struct {
	// Latency records the latency of every operation counted.
	Latency bool
	// CountBusy counts the operations that found the key busy as
	// operations: a hot key's refused attempts are what is measured.
	CountBusy bool
	// Started and Stopped, when set, are called just before the workers
	// start and just after the last one stopped: what a caller reads
	// around the run (WAL position, allocations) sees no worker's set-up.
	Started, Stopped func()
	// Over, when set, is closed when the duration has passed: an Op that
	// waits for another worker stops waiting then.
	Over chan struct{}
}

// Result is what a run measured.
type Result struct {
	Ops, Busy, Errors uint64
	FirstError        error
	// Elapsed is from the start until every worker stopped: workers stop
	// between operations, so that no statement is cut off by the end of
	// the run (a cut-off acquire may be granted without the worker
	// learning it).
	Elapsed time.Duration
	// Latency is nil unless RunOptions.Latency.
	Latency *Hist
}

// Rate is the operations per second.
func (r Result) Rate() float64 { return float64(r.Ops) / r.Elapsed.Seconds() }

// Run runs ops, one goroutine each, until d has passed, and returns what
// they did. An operation that fails is counted and its worker pauses a
// millisecond; once ctx ends (an interrupt), a failing worker stops
// without counting the failure.
func Run(ctx context.Context, ops []Op, d time.Duration, o RunOptions) Result {
	var (
		stop     atomic.Bool
		count    atomic.Uint64
		busy     atomic.Uint64
		errs     atomic.Uint64
		errOnce  sync.Once
		firstErr error
		wg       sync.WaitGroup
		start    = make(chan struct{})
		hists    = make([]*Hist, len(ops))
	)
	for i, op := range ops {
		if o.Latency {
			hists[i] = new(Hist)
		}
		wg.Add(1)
		go func(h *Hist) {
			defer wg.Done()
			var n, nb uint64
			<-start
			for !stop.Load() {
				var t0 time.Time
				if h != nil {
					t0 = time.Now()
				}
				held, err := op(ctx)
				switch {
				case err != nil:
					if ctx.Err() != nil {
						return
					}
					errs.Add(1)
					errOnce.Do(func() { firstErr = err })
					time.Sleep(time.Millisecond)
				case held || o.CountBusy:
					n++
					if h != nil {
						h.Add(time.Since(t0))
					}
					if !held {
						nb++
					}
				default:
					nb++
				}
			}
			count.Add(n)
			busy.Add(nb)
		}(hists[i])
	}
	if o.Started != nil {
		o.Started()
	}
	t0 := time.Now()
	close(start)
	timer := time.AfterFunc(d, func() {
		stop.Store(true)
		if o.Over != nil {
			close(o.Over)
		}
	})
	wg.Wait()
	elapsed := time.Since(t0)
	if timer.Stop() && o.Over != nil {
		close(o.Over) // every worker stopped before d: ctx ended
	}
	if o.Stopped != nil {
		o.Stopped()
	}
	r := Result{Ops: count.Load(), Busy: busy.Load(), Errors: errs.Load(), FirstError: firstErr, Elapsed: elapsed}
	if o.Latency {
		r.Latency = new(Hist)
		for _, h := range hists {
			r.Latency.Merge(h)
		}
	}
	return r
}
