// Package groupcommit is the client-side group commit that the
// PostgreSQL, MariaDB and etcd backends share: concurrent calls of one
// kind (acquires, releases) of one Backend are coalesced into one batch
// request, one commit, while the Backend is busy.
//
// It never adds latency to a Backend that is not busy: a call is sent at
// once, alone, with its single request, while fewer than [Queue.Limit]
// calls of its kind are in flight, or while at most [Queue.Calls] are
// outstanding. Only a call that arrives while that many are in flight
// waits, in a queue; the sender of the next one to finish (single or
// batch) hands the queue to a goroutine of its own, which sends it as
// batches, one after the other, until the queue is empty, in the finished
// call's place in flight. The rules a batch keeps:
//   - one call per key in a batch: a second call for a key stays queued
//     for a later batch, behind the first (a key's calls go in arrival
//     order); a call of several keys ([Queue.DoKeys], a set acquired all
//     or none) shares a batch with no other call of any of its keys;
//   - at most [Queue.MaxMembers] members, and at most [Queue.MaxSize] of
//     the members' sizes together (a member that alone is larger goes
//     alone);
//   - a batch of one member is not sent as a batch: that member sends its
//     single request itself, in the batch's place in flight (a batch
//     request costs the server more for one key, and saves no commit);
//   - a call whose context ends while it is queued leaves the queue, and
//     nothing of it is ever sent ([Queue.NotSent]); one whose context
//     ends while its batch is in flight returns at once with the single
//     call's in-flight error ([Queue.InFlight]), and the batch goes on for
//     the others: its context is cancelled only when every member has
//     left (or when it ends);
//   - a member that [Queue.Send] left unsettled ([ErrAlone]: its batch
//     was refused, never sent, or did not decide its key) is sent again
//     alone, with its single request, unless its context has ended
//     meanwhile (then it was not sent).
//
// What a batch's outcome means (a lost reply makes every member
// indeterminate; a refused batch applied nothing) is the dialect's to
// decide in Send: the queue only carries each member's result.
package groupcommit

import (
	"context"
	"errors"
	"slices"
	"sync"
	"sync/atomic"
)

// ErrAlone is the error [Queue.Send] sets on a member whose batch did not
// settle it: the member then sends its request alone, with the single
// request, and gets the single request's answer.
var ErrAlone = errors.New("groupcommit: send alone")

// errSentAlone is a member's result when it was the only member of its
// batch: it sends its request with the single request and keeps the
// place in flight that its batch had.
var errSentAlone = errors.New("groupcommit: sole member")

// Member is one queued call, as [Queue.Send] sees it.
type Member[Req, Res any] struct {
	Ctx  context.Context // the caller's context (to translate an error for its caller)
	Key  string
	Req  Req
	size int
	keys []string // every key of a call of several ([Queue.DoKeys]); nil: Key alone

	// Res and Err are the member's outcome, set by Send; Err [ErrAlone]
	// has the member sent alone.
	Res Res
	Err error

	done  chan struct{} // closed when Res and Err are set
	batch *batch        // nil while queued; guarded by the queue's mu
}

// batch is what the members of one batch in flight share.
type batch struct {
	live   int                // members still waiting for the reply; guarded by the queue's mu
	cancel context.CancelFunc // cancels the batch's request: called when live reaches 0, or after it
}

// Queue coalesces the calls of one kind. Its fields are set before its
// first call and not changed after, except by tests. It is safe for
// concurrent use.
type Queue[Req, Res any] struct {
	// Limit is how many requests of this kind (single or batch) may be in
	// flight before calls queue; 0 turns group commit off (every call is
	// sent alone at once).
	Limit int
	// Calls is how many calls of this kind must be outstanding (in flight
	// alone, queued, or in a batch), this one included, before one may
	// queue: up to Calls, every call goes alone at once. 0: no such rule.
	Calls int
	// MaxMembers bounds the members of one batch; 0: no bound.
	MaxMembers int
	// MaxSize bounds the sum of the members' sizes (see [Queue.Do]) in one
	// batch; 0: no bound.
	MaxSize int
	// Send sends members (distinct keys, in arrival order) as one batch
	// request and sets each member's Res and Err. Its ctx ends only when
	// every member has left, or after Send returns.
	Send func(ctx context.Context, members []*Member[Req, Res])
	// Parent returns the context that a batch's context derives from;
	// nil: context.Background.
	Parent func() context.Context
	// NotSent and InFlight return the error of a call for key whose
	// context ended (with err) while it was queued (nothing of it was
	// sent), and while its batch was in flight (its outcome unknown).
	NotSent, InFlight func(key string, err error) error

	batches atomic.Int64 // batch requests sent
	alone   atomic.Int64 // members that a batch left to be sent alone

	outstanding atomic.Int64 // calls inside Do

	mu       sync.Mutex
	inFlight int                 // requests of this kind in flight
	queue    []*Member[Req, Res] // in arrival order
}

// Do runs one call for key: single, its single request, at once while
// fewer than Limit requests are in flight or at most Calls calls are
// outstanding; else req is queued for the next batch, counted as size
// against MaxSize. It returns single's result, or the member's outcome
// from its batch, or the NotSent or InFlight error.
func (q *Queue[Req, Res]) Do(ctx context.Context, key string, size int, req Req, single func(context.Context) (Res, error)) (Res, error) {
	return q.do(ctx, key, nil, size, req, single)
}

// DoKeys is [Queue.Do] for a call of several keys (keys[0] names it in
// its errors): a batch carries at most one call of each key, so a call
// of several keys shares a batch with no other call of any of them.
func (q *Queue[Req, Res]) DoKeys(ctx context.Context, keys []string, size int, req Req, single func(context.Context) (Res, error)) (Res, error) {
	return q.do(ctx, keys[0], keys, size, req, single)
}

func (q *Queue[Req, Res]) do(ctx context.Context, key string, keys []string, size int, req Req, single func(context.Context) (Res, error)) (Res, error) {
	if q.Limit <= 0 {
		return single(ctx)
	}
	n := q.outstanding.Add(1)
	defer q.outstanding.Add(-1)
	q.mu.Lock()
	if q.inFlight < q.Limit || n <= int64(q.Calls) {
		q.inFlight++
		q.mu.Unlock()
		res, err := single(ctx)
		q.finished()
		return res, err
	}
	m := &Member[Req, Res]{Ctx: ctx, Key: key, Req: req, size: size, keys: keys, done: make(chan struct{})}
	q.queue = append(q.queue, m)
	q.mu.Unlock()
	var zero Res
	select {
	case <-m.done:
	case <-ctx.Done():
		q.mu.Lock()
		select {
		case <-m.done: // answered meanwhile
			q.mu.Unlock()
		default:
			if m.batch == nil {
				// Still queued: leave, and nothing of this call is sent.
				q.queue = slices.DeleteFunc(q.queue, func(o *Member[Req, Res]) bool { return o == m })
				q.mu.Unlock()
				return zero, q.NotSent(key, ctx.Err())
			}
			m.batch.live--
			if m.batch.live == 0 {
				m.batch.cancel()
			}
			q.mu.Unlock()
			return zero, q.InFlight(key, ctx.Err())
		}
	}
	if (m.Err == errSentAlone || m.Err == ErrAlone) && ctx.Err() != nil {
		// Nothing of this call was applied: its batch did not settle it,
		// and it has not been sent alone.
		if m.Err == errSentAlone {
			q.finished()
		}
		return zero, q.NotSent(key, ctx.Err())
	}
	switch m.Err {
	case errSentAlone:
		// This call has its batch's place in flight.
		res, err := single(ctx)
		q.finished()
		return res, err
	case ErrAlone:
		q.alone.Add(1)
		return single(ctx)
	}
	return m.Res, m.Err
}

// finished is called when a request of this kind ends: the queue, if
// any, goes next as batches, sent from a goroutine of its own (the caller
// returns to its own caller), which keeps the finished request's place
// in flight.
func (q *Queue[Req, Res]) finished() {
	q.mu.Lock()
	members, ctx, handed := q.take()
	if members == nil && !handed {
		q.inFlight--
	}
	q.mu.Unlock()
	if members != nil {
		go q.run(ctx, members)
	}
}

// run sends batches until the queue is empty.
func (q *Queue[Req, Res]) run(ctx context.Context, members []*Member[Req, Res]) {
	for members != nil {
		q.batches.Add(1)
		q.Send(ctx, members)
		q.mu.Lock()
		members[0].batch.cancel()
		for _, m := range members {
			close(m.done)
		}
		var handed bool
		members, ctx, handed = q.take()
		if members == nil && !handed {
			q.inFlight--
		}
		q.mu.Unlock()
	}
}

// take removes the next batch from the queue: in arrival order, one
// member per key (a later call for a key stays queued, and so does every
// call of a key that stays queued; a call of several keys counts each),
// at most MaxMembers, within MaxSize (but never none: the first member is
// taken whatever its size). It
// returns nil when the queue is empty. A batch of one member is not sent
// as a batch: take hands that member the place in flight (handed), and it
// sends its request itself, alone. q.mu is held.
func (q *Queue[Req, Res]) take() (members []*Member[Req, Res], ctx context.Context, handed bool) {
	if len(q.queue) == 0 {
		return nil, nil, false
	}
	seen := make(map[string]bool, len(q.queue))
	rest := q.queue[:0]
	size := 0
	for _, m := range q.queue {
		clash := seen[m.Key] // m.keys, when set, starts with m.Key
		for _, k := range m.keys {
			clash = clash || seen[k]
		}
		seen[m.Key] = true
		for _, k := range m.keys {
			seen[k] = true
		}
		if clash || (q.MaxMembers > 0 && len(members) >= q.MaxMembers) || (q.MaxSize > 0 && len(members) > 0 && size+m.size > q.MaxSize) {
			rest = append(rest, m)
			continue
		}
		size += m.size
		members = append(members, m)
	}
	clear(q.queue[len(rest):])
	q.queue = rest
	if len(members) == 1 {
		members[0].Err = errSentAlone
		close(members[0].done)
		return nil, nil, true
	}
	parent := context.Background()
	if q.Parent != nil {
		parent = q.Parent()
	}
	ctx, cancel := context.WithCancel(parent)
	b := &batch{cancel: cancel, live: len(members)}
	for _, m := range members {
		m.batch = b
	}
	return members, ctx, false
}

// Batches returns how many batch requests the queue has sent.
func (q *Queue[Req, Res]) Batches() int64 { return q.batches.Load() }

// Alone returns how many members of batches were sent again alone
// ([ErrAlone]).
func (q *Queue[Req, Res]) Alone() int64 { return q.alone.Load() }

// Queued returns how many calls wait in the queue.
func (q *Queue[Req, Res]) Queued() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return len(q.queue)
}

// Hold fills the places in flight, as if Limit requests were being sent,
// and drops the Calls rule, so that every call queues until [Queue.Flush]
// (for tests that make batches on purpose).
func (q *Queue[Req, Res]) Hold() {
	q.mu.Lock()
	defer q.mu.Unlock()
	q.inFlight = q.Limit
	q.Calls = 0
}

// Flush ends one request in flight, as its end would: the queue goes as
// batches (for tests, after [Queue.Hold]).
func (q *Queue[Req, Res]) Flush() { q.finished() }

// Unhold frees the places that [Queue.Hold] took and reports true once the
// queue is empty and the batches that [Queue.Flush] started have ended;
// else it changes nothing and reports false (for tests).
func (q *Queue[Req, Res]) Unhold() bool {
	q.mu.Lock()
	defer q.mu.Unlock()
	if len(q.queue) == 0 && q.inFlight == q.Limit-1 {
		q.inFlight = 0
		return true
	}
	return false
}

// Sending returns how many requests of this kind are in flight.
func (q *Queue[Req, Res]) Sending() int {
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.inFlight
}
