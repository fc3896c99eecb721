package groupcommit

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"

	"github.com/stretchr/testify/require"
)

// The queue's rules, with fake single and batch requests inside synctest
// bubbles: a request "in flight" is a goroutine blocked on a channel the
// test controls, and synctest.Wait lets every other goroutine settle
// before the test looks.

var (
	errNotSent  = errors.New("not sent")
	errInFlight = errors.New("in flight")
)

// fake records what a Queue[string, string] sends. A request is its key;
// its result is "single:KEY" or "batch:KEY".
type fake struct {
	q *Queue[string, string]

	mu      sync.Mutex
	singles []string   // keys sent alone, in order
	batches [][]string // each batch's keys, in order
	ctxs    []context.Context

	gate      chan struct{} // when set, a single request waits for a receive (or a close)
	batchGate chan struct{} // when set, a batch request waits for a receive (or a close)
	alone     map[string]bool
}

func newFake(limit int) *fake {
	f := &fake{alone: make(map[string]bool)}
	f.q = &Queue[string, string]{Limit: limit, Send: f.send,
		NotSent:  func(key string, err error) error { return fmt.Errorf("%w: %s: %w", errNotSent, key, err) },
		InFlight: func(key string, err error) error { return fmt.Errorf("%w: %s: %w", errInFlight, key, err) }}
	return f
}

func (f *fake) single(key string) func(context.Context) (string, error) {
	return func(context.Context) (string, error) {
		f.mu.Lock()
		f.singles = append(f.singles, key)
		gate := f.gate
		f.mu.Unlock()
		if gate != nil {
			<-gate
		}
		return "single:" + key, nil
	}
}

func (f *fake) send(ctx context.Context, ms []*Member[string, string]) {
	keys := make([]string, len(ms))
	for i, m := range ms {
		keys[i] = m.Key
	}
	f.mu.Lock()
	f.batches = append(f.batches, keys)
	f.ctxs = append(f.ctxs, ctx)
	gate := f.batchGate
	f.mu.Unlock()
	if gate != nil {
		<-gate
	}
	for _, m := range ms {
		if f.alone[m.Key] {
			m.Err = ErrAlone
			continue
		}
		m.Res = "batch:" + m.Req
	}
}

func (f *fake) sent() (singles []string, batches [][]string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return slices.Clone(f.singles), slices.Clone(f.batches)
}

type result struct {
	res string
	err error
}

// call runs one Do for key in a goroutine of its own.
func (f *fake) call(ctx context.Context, key string, size int) <-chan result {
	ch := make(chan result, 1)
	go func() {
		res, err := f.q.Do(ctx, key, size, key, f.single(key))
		ch <- result{res, err}
	}()
	return ch
}

// queued holds f's queue, queues a call for each key (in that order) and
// returns their results' channels.
func (f *fake) queued(t *testing.T, ctx context.Context, keys ...string) []<-chan result {
	t.Helper()
	f.q.Hold()
	before := f.q.Queued()
	out := make([]<-chan result, len(keys))
	for i, k := range keys {
		out[i] = f.call(ctx, k, 1)
		synctest.Wait() // in arrival order
	}
	require.Equal(t, before+len(keys), f.q.Queued())
	return out
}

// While fewer than Limit requests are in flight a call is sent at once,
// alone; the next one queues.
func TestInFlightLimit(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(2)
		f.gate = make(chan struct{})
		a, b := f.call(t.Context(), "a", 1), f.call(t.Context(), "b", 1)
		synctest.Wait()
		singles, _ := f.sent()
		require.ElementsMatch(t, []string{"a", "b"}, singles, "two calls go at once under a limit of 2")
		require.Equal(t, 2, f.q.Sending())
		c := f.call(t.Context(), "c", 1)
		synctest.Wait()
		singles, _ = f.sent()
		require.Len(t, singles, 2, "a third call went alone beyond the limit")
		require.Equal(t, 1, f.q.Queued())
		f.gate <- struct{}{} // one single ends: c is a queue of one, sent alone in its place
		synctest.Wait()
		close(f.gate)
		for _, ch := range []<-chan result{a, b, c} {
			r := <-ch
			require.NoError(t, r.err)
		}
		singles, batches := f.sent()
		require.Len(t, singles, 3)
		require.Empty(t, batches)
		require.Zero(t, f.q.Sending())
	})
}

// Limit 0 is group commit off: every call goes alone at once.
func TestLimitZeroSendsEveryCallAlone(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(0)
		f.gate = make(chan struct{})
		var chs []<-chan result
		for i := range 5 {
			chs = append(chs, f.call(t.Context(), fmt.Sprint("k", i), 1))
		}
		synctest.Wait()
		close(f.gate)
		for _, ch := range chs {
			require.NoError(t, (<-ch).err)
		}
		singles, batches := f.sent()
		require.Len(t, singles, 5)
		require.Empty(t, batches)
	})
}

// Up to Calls outstanding calls of a kind are each sent alone at once,
// however many requests are in flight (group commit engages only when
// more are waiting: few-member batches lost to single statements on
// MariaDB); the next one queues for a batch.
func TestGroupCommitEngagesOnlyBeyondCalls(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(1)
		f.q.Calls = 3
		f.gate = make(chan struct{})
		var chs []<-chan result
		for i := range 3 {
			chs = append(chs, f.call(t.Context(), fmt.Sprint("k", i), 1))
		}
		synctest.Wait()
		singles, _ := f.sent()
		require.Len(t, singles, 3, "3 outstanding calls did not all go alone")
		for i := 3; i < 5; i++ {
			chs = append(chs, f.call(t.Context(), fmt.Sprint("k", i), 1))
		}
		synctest.Wait()
		require.Equal(t, 2, f.q.Queued())
		singles, _ = f.sent()
		require.Len(t, singles, 3, "a fourth call went alone")
		close(f.gate)
		for i, ch := range chs {
			r := <-ch
			require.NoError(t, r.err)
			if i >= 3 {
				require.Equal(t, fmt.Sprint("batch:k", i), r.res)
			}
		}
		require.EqualValues(t, 1, f.q.Batches(), "the queued calls went as one batch")
		singles, _ = f.sent()
		require.Len(t, singles, 3)
	})
}

// A batch takes one call per key: a second call for a key stays queued,
// for the next batch, and so does a later call of a key that stayed.
func TestOneKeyPerBatch(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(1)
		chs := f.queued(t, t.Context(), "a", "a", "b", "a", "c", "b")
		f.q.Flush()
		for _, ch := range chs {
			require.NoError(t, (<-ch).err)
		}
		singles, batches := f.sent()
		require.Equal(t, [][]string{{"a", "b", "c"}, {"a", "b"}}, batches)
		require.Equal(t, []string{"a"}, singles, "the third call of a went alone, as a queue of one")
		require.True(t, f.q.Unhold())
	})
}

// A call of several keys (DoKeys, named by its first key in the fake)
// shares a batch with no other call of any of its keys, the first or any
// other: "a+b" and "b+c" never go together, nor "a+b" and "a", nor "d+e"
// and "f+d"; a call after a clash that clashes with nothing taken still
// joins.
func TestOneKeyPerBatchAcrossSets(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(1)
		f.q.Hold()
		var chs []<-chan result
		for _, keys := range [][]string{{"a", "b"}, {"b", "c"}, {"a"}, {"d", "e"}, {"c"}, {"f", "d"}} {
			ch := make(chan result, 1)
			go func() {
				res, err := f.q.DoKeys(t.Context(), keys, len(keys), keys[0], f.single(keys[0]))
				ch <- result{res, err}
			}()
			synctest.Wait()
			chs = append(chs, ch)
		}
		require.Equal(t, 6, f.q.Queued())
		f.q.Flush()
		for _, ch := range chs {
			require.NoError(t, (<-ch).err)
		}
		_, batches := f.sent()
		require.Equal(t, [][]string{{"a", "d"}, {"b", "a", "f"}}, batches,
			"first batch: a+b and d+e (b+c clashes on b, a on a, c on b+c's c, f+d on its second key); then b+c, a and f+d (c clashes with b+c)")
		require.True(t, f.q.Unhold())
	})
}

// A batch takes at most MaxMembers calls; the rest go in the next.
func TestMaxMembers(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(1)
		f.q.MaxMembers = 3
		chs := f.queued(t, t.Context(), "a", "b", "c", "d", "e", "f", "g")
		f.q.Flush()
		for _, ch := range chs {
			require.NoError(t, (<-ch).err)
		}
		singles, batches := f.sent()
		require.Equal(t, [][]string{{"a", "b", "c"}, {"d", "e", "f"}}, batches)
		require.Equal(t, []string{"g"}, singles)
	})
}

// A batch's members' sizes stay within MaxSize; a call that is larger on
// its own still goes (alone), never stays queued for ever; a key that
// waits for room keeps its later calls behind it.
func TestMaxSize(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(1)
		f.q.MaxSize = 10
		f.q.Hold()
		var chs []<-chan result
		for _, c := range []struct {
			key  string
			size int
		}{{"a", 4}, {"b", 4}, {"c", 4}, {"d", 2}, {"c", 1}, {"e", 30}, {"f", 5}} {
			chs = append(chs, f.call(t.Context(), c.key, c.size))
			synctest.Wait()
		}
		f.q.Flush()
		for _, ch := range chs {
			require.NoError(t, (<-ch).err)
		}
		singles, batches := f.sent()
		require.Equal(t, [][]string{{"a", "b", "d"}, {"c", "f"}}, batches)
		require.Equal(t, []string{"c", "e"}, singles, "then c alone, and e, too large to share")

		// A call larger than MaxSize alone in the queue is sent alone.
		f = newFake(1)
		f.q.MaxSize = 10
		chs = f.queued(t, t.Context(), "big")
		f.q.Flush()
		require.NoError(t, (<-chs[0]).err)
		singles, batches = f.sent()
		require.Empty(t, batches)
		require.Equal(t, []string{"big"}, singles)
	})
}

// A call whose context ends while it is queued returns at once, not sent,
// and nothing of it is ever sent: neither in a batch nor alone.
func TestLeaveWhileQueuedSendsNothing(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(1)
		ctx, cancel := context.WithCancel(t.Context())
		gone := f.queued(t, ctx, "gone")[0]
		rest := f.queued(t, t.Context(), "a", "b")
		cancel()
		synctest.Wait()
		r := <-gone
		require.ErrorIs(t, r.err, errNotSent)
		require.ErrorIs(t, r.err, context.Canceled)
		require.Equal(t, 2, f.q.Queued(), "the call left the queue")
		f.q.Flush()
		for _, ch := range rest {
			require.NoError(t, (<-ch).err)
		}
		singles, batches := f.sent()
		require.Equal(t, [][]string{{"a", "b"}}, batches)
		require.Empty(t, singles)
	})
}

// A member whose context ends while its batch is in flight returns at
// once with the in-flight error; the batch goes on for the others, its
// context not cancelled until it ends. When every member has left, the
// batch's context is cancelled.
func TestLeaveWhileInFlight(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(1)
		f.batchGate = make(chan struct{})
		ctx, cancel := context.WithCancel(t.Context())
		gone := f.queued(t, ctx, "gone")[0]
		stay := f.queued(t, t.Context(), "stay")[0]
		f.q.Flush()
		synctest.Wait() // the batch is in flight
		cancel()
		synctest.Wait()
		select {
		case r := <-gone:
			require.ErrorIs(t, r.err, errInFlight)
			require.ErrorIs(t, r.err, context.Canceled)
		default:
			t.Fatal("a member that left waits for its batch")
		}
		f.mu.Lock()
		bctx := f.ctxs[0]
		f.mu.Unlock()
		require.NoError(t, bctx.Err(), "one member left: the batch was cancelled for the other")
		f.batchGate <- struct{}{}
		r := <-stay
		require.NoError(t, r.err)
		require.Equal(t, "batch:stay", r.res)
		synctest.Wait()
		require.Error(t, bctx.Err(), "a batch's context ends with it")

		// Every member leaves: the batch in flight is cancelled.
		ctx, cancel = context.WithCancel(t.Context())
		chs := f.queued(t, ctx, "x", "y")
		f.q.Flush()
		synctest.Wait()
		f.mu.Lock()
		bctx = f.ctxs[1]
		f.mu.Unlock()
		cancel()
		synctest.Wait()
		require.ErrorIs(t, bctx.Err(), context.Canceled, "every member left and the batch goes on")
		for _, ch := range chs {
			require.ErrorIs(t, (<-ch).err, errInFlight)
		}
		close(f.batchGate)
	})
}

// The batch's context derives from Parent.
func TestBatchContextFromParent(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(1)
		parent, stop := context.WithCancel(t.Context())
		f.q.Parent = func() context.Context { return parent }
		f.batchGate = make(chan struct{})
		chs := f.queued(t, t.Context(), "a", "b")
		f.q.Flush()
		synctest.Wait()
		stop()
		f.mu.Lock()
		bctx := f.ctxs[0]
		f.mu.Unlock()
		require.Error(t, bctx.Err())
		close(f.batchGate)
		for _, ch := range chs {
			require.NoError(t, (<-ch).err)
		}
	})
}

// The sender of the call that ends hands the queue to a goroutine that
// sends batches, one after the other, until the queue is empty, in the
// finished call's place in flight: the sender returns at once, and no
// more requests are in flight than the limit.
func TestHandOffDrainsUntilEmpty(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(1)
		f.gate = make(chan struct{})
		f.batchGate = make(chan struct{})
		first := f.call(t.Context(), "first", 1)
		synctest.Wait()
		var chs []<-chan result
		for _, k := range []string{"a", "b"} {
			chs = append(chs, f.call(t.Context(), k, 1))
			synctest.Wait()
		}
		synctest.Wait()
		require.Equal(t, 2, f.q.Queued())
		f.gate <- struct{}{} // first ends: a and b go as a batch
		r := <-first
		require.NoError(t, r.err, "the sender of the finished call returned while the batch is in flight")
		synctest.Wait()
		require.Equal(t, 1, f.q.Sending(), "the batch took the finished call's place")
		for _, k := range []string{"c", "d", "e"} {
			chs = append(chs, f.call(t.Context(), k, 1))
			synctest.Wait()
		}
		synctest.Wait()
		require.Equal(t, 3, f.q.Queued(), "calls queue behind the batch in flight")
		f.batchGate <- struct{}{} // the first batch ends: the second goes
		synctest.Wait()
		require.Equal(t, 1, f.q.Sending())
		require.Zero(t, f.q.Queued())
		f.batchGate <- struct{}{}
		for _, ch := range chs {
			r := <-ch
			require.NoError(t, r.err)
			require.Contains(t, r.res, "batch:")
		}
		synctest.Wait()
		require.Zero(t, f.q.Sending(), "the queue drained, and its place was freed")
		_, batches := f.sent()
		require.Equal(t, [][]string{{"a", "b"}, {"c", "d", "e"}}, batches)
		require.EqualValues(t, 2, f.q.Batches())
	})
}

// A queue of one call is not sent as a batch: that call sends its single
// request, in the batch's place in flight.
func TestQueueOfOneSentAlone(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(1)
		f.gate = make(chan struct{})
		first := f.call(t.Context(), "first", 1)
		synctest.Wait()
		one := f.call(t.Context(), "one", 1)
		synctest.Wait()
		f.gate <- struct{}{}
		require.NoError(t, (<-first).err)
		synctest.Wait()
		singles, batches := f.sent()
		require.Equal(t, []string{"first", "one"}, singles)
		require.Empty(t, batches)
		require.Equal(t, 1, f.q.Sending(), "the sole member holds the place in flight")
		two := f.call(t.Context(), "two", 1)
		synctest.Wait()
		require.Equal(t, 1, f.q.Queued(), "the limit still holds while the sole member is sent")
		close(f.gate)
		for _, ch := range []<-chan result{one, two} {
			r := <-ch
			require.NoError(t, r.err)
			require.Contains(t, r.res, "single:")
		}
		synctest.Wait()
		require.Zero(t, f.q.Sending())
		require.Zero(t, f.q.Batches())
	})
}

// A member that Send leaves unsettled (ErrAlone) is sent alone, and gets
// the single request's answer; unless its context ended meanwhile: then
// nothing more is sent, and it was not sent.
func TestErrAloneSendsAlone(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(1)
		f.alone["b"] = true
		chs := f.queued(t, t.Context(), "a", "b")
		f.q.Flush()
		ra, rb := <-chs[0], <-chs[1]
		require.Equal(t, result{res: "batch:a"}, ra)
		require.Equal(t, result{res: "single:b"}, rb)
		require.EqualValues(t, 1, f.q.Alone())

		// Its context has ended by the time its batch answers (endedCtx: a
		// context that reports its end without waking anyone): not sent
		// again.
		f = newFake(1)
		f.alone["b"] = true
		ended := &endedCtx{Context: t.Context()}
		chs = f.queued(t, t.Context(), "a")
		chs = append(chs, f.queued(t, ended, "b")...)
		ended.end.Store(true)
		f.q.Flush()
		require.Equal(t, result{res: "batch:a"}, <-chs[0])
		rb = <-chs[1]
		require.ErrorIs(t, rb.err, errNotSent)
		singles, _ := f.sent()
		require.Empty(t, singles, "a member whose context ended was sent alone")
		require.Zero(t, f.q.Alone())
	})
}

// The sole member of a batch whose context has ended when it is handed
// its turn is not sent, and frees the place in flight it was handed.
func TestQueueOfOneContextEnded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := newFake(1)
		ended := &endedCtx{Context: t.Context()}
		ch := f.queued(t, ended, "one")[0]
		ended.end.Store(true)
		f.q.Flush()
		r := <-ch
		require.ErrorIs(t, r.err, errNotSent)
		singles, _ := f.sent()
		require.Empty(t, singles)
		synctest.Wait()
		require.Equal(t, f.q.Limit-1, f.q.Sending(), "the place in flight was not freed")
	})
}

// endedCtx is a context whose Err says canceled once end is set, while
// its Done channel is its parent's: a call that waits on Done is not
// woken by the end, and only a look at Err sees it.
type endedCtx struct {
	context.Context
	end atomic.Bool
}

func (c *endedCtx) Err() error {
	if c.end.Load() {
		return context.Canceled
	}
	return c.Context.Err()
}
