package lockbench

import (
	"context"
	"sync"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// Handoff is the handoff workload: workers wait in Acquire on shared keys
// (two or more workers per key, worker w on key w % len(keys)); each
// holder releases at once and then waits for another worker to take the
// key before it queues again. An operation is held (counted) when its
// worker took the key from another one, and its latency is from the start
// of that worker's release to the moment the key is held again: handoffs
// per second while waiters queue. Run it with RunOptions.Over set to
// h.Over, and read the latencies from h.Latency once Run has returned.
type Handoff struct {
	// Over is closed by Run at the end of the duration: a holder stops
	// waiting for the next one then.
	Over chan struct{}

	ops   []Op
	hists []*Hist
}

// handoffKey is the shared state of one key of the handoff workload.
type handoffKey struct {
	mu         sync.Mutex
	releasedAt time.Time     // when the last holder started its release
	releaser   int           // which worker that was; -1 before the first
	acquired   chan struct{} // closed at the next acquisition
}

// NewHandoff makes the handoff workload of workers workers on keys,
// acquiring through c.
func NewHandoff(c *sqllock.Client, keys []string, workers int) *Handoff {
	h := &Handoff{Over: make(chan struct{})}
	states := make([]*handoffKey, len(keys))
	for i := range states {
		states[i] = &handoffKey{releaser: -1, acquired: make(chan struct{})}
	}
	for w := range workers {
		hist := new(Hist)
		h.hists = append(h.hists, hist)
		k := w % len(keys)
		h.ops = append(h.ops, h.op(c, keys[k], states[k], w, hist))
	}
	return h
}

// Ops are the workers' operations, for Run.
func (h *Handoff) Ops() []Op { return h.ops }

// Latency merges the workers' handoff latencies; call it after Run.
func (h *Handoff) Latency() *Hist {
	all := new(Hist)
	for _, w := range h.hists {
		all.Merge(w)
	}
	return all
}

// op is worker w's operation on key, whose state st it shares with the
// other workers of key; it records its handoffs' latencies in hist.
func (h *Handoff) op(c *sqllock.Client, key string, st *handoffKey, w int, hist *Hist) Op {
	return func(ctx context.Context) (bool, error) {
		// Not cancelled at the end of the run: every waiter gets the key
		// in turn, as each holder releases it, and then stops.
		g, err := c.Acquire(ctx, key, &sqllock.AcquireOptions{Wait: sqllock.WaitForever})
		if err != nil {
			return false, err
		}
		now := time.Now()
		st.mu.Lock()
		handoff := st.releaser >= 0 && st.releaser != w
		if handoff {
			hist.Add(now.Sub(st.releasedAt))
		}
		close(st.acquired)
		st.acquired = make(chan struct{})
		next := st.acquired
		st.releasedAt, st.releaser = time.Now(), w
		st.mu.Unlock()
		if err := g.Release(context.WithoutCancel(ctx)); err != nil {
			return handoff, err
		}
		select { // let a waiter have it before queueing again
		case <-next:
		case <-h.Over:
		case <-ctx.Done():
		}
		return handoff, nil
	}
}
