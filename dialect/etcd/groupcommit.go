package etcd

import (
	"context"
	"errors"
	"slices"
	"sync"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/internal/outcome"
)

// Group commit: concurrent grants (TryAcquire's first transaction, without
// a min hold) of one Backend share one transaction, one raft entry, as
// nested transactions, one per grant; so do concurrent flat releases (see
// releaseTxn), in transactions of their own.
//
// It adds no latency to a Backend that is not busy: a call is sent at
// once, alone, with its single transaction, while fewer than groupInFlight
// of its kind are in flight. Only one that comes while that many are in
// flight waits in a queue; the sender of the next one to finish hands the
// queue to a goroutine that sends it in batches until it is empty. The
// rules a batch keeps:
//   - one call per key in a batch: a second one for a key stays queued
//     for the next batch;
//   - at most [Options.MaxTxnOps] less the nested transaction's width
//     calls (etcd counts a nested transaction's operations against what
//     its parent leaves), and at most maxBatchBytes of request;
//   - a call whose nested transaction failed (its compares did not hold:
//     the key taken, changed, or not held by the lease released) changed
//     nothing, and is sent again alone, with the single transaction: it
//     gets the single call's answer;
//   - a call whose context ends while it is queued leaves the queue, and
//     nothing of it is ever sent; one whose context ends while its batch
//     is in flight returns at once, as the single call's in-flight error
//     (an acquire's is indeterminate), and the batch goes on for the
//     others (it is cancelled only when every member has left);
//   - a batch whose reply is lost (it may have been applied) makes every
//     member's outcome unknown, as the single call's lost reply (the same
//     owner's repeated acquire gets its grant back); a batch that etcd
//     refused, or that never reached it, applied nothing: each member is
//     sent again alone;
//   - a queue of one is sent alone: a nested transaction costs etcd more.
type txnGroup struct {
	op    outcome.Op
	width int // operations of a member's nested transaction, as etcd counts them

	mu       sync.Mutex // guards inFlight, queue
	inFlight int
	queue    []*groupCall
}

// groupInFlight is how many calls of a kind (single or batches) a Backend
// sends concurrently before it queues further ones for a batch: 4, as the
// PostgreSQL backend's group commit, whose measurements found that with 2
// a third caller at 4 goroutines waits where it could have gone at once
// (not told apart for etcd yet: the runs at hand varied by ±15%).
const groupInFlight = 4

// maxBatchBytes bounds a batch's request: under etcd's default
// --max-request-bytes (1.5 MiB), with room for the envelope.
const maxBatchBytes = 1 << 20

// groupCall is one queued call.
type groupCall struct {
	ctx  context.Context
	key  string
	op   clientv3.Op       // its nested transaction
	size int               // about the bytes op adds to a request
	done chan groupOutcome // buffered: a batch never waits for a caller gone
	b    *groupBatch       // set when taken into a batch, under txnGroup.mu
}

// groupBatch is a batch in flight: its context, cancelled when every
// member has left.
type groupBatch struct {
	ctx    context.Context
	cancel context.CancelFunc
	mu     sync.Mutex // guards left
	left   int
	n      int
}

func (gb *groupBatch) leave() {
	gb.mu.Lock()
	defer gb.mu.Unlock()
	gb.left++
	if gb.left == gb.n {
		gb.cancel()
	}
}

// groupOutcome is what a queued call learns of its batch: an error
// (translated), or its nested transaction's response when it succeeded,
// with the batch's revision; neither: send it alone.
type groupOutcome struct {
	err error
	tr  *etcdserverpb.TxnResponse
	rev int64
}

// viaGroup sends a call of g's kind for key: single, its single
// transaction, when sent alone (its response or error, untranslated,
// returned), else op, its nested form, in a batch (the batch's outcome
// returned, with a nil error).
func (b *Backend) viaGroup(ctx context.Context, g *txnGroup, key string, op clientv3.Op, size int, single func() (*clientv3.TxnResponse, error)) (*clientv3.TxnResponse, groupOutcome, error) {
	g.mu.Lock()
	if g.inFlight < groupInFlight {
		g.inFlight++
		g.mu.Unlock()
		resp, err := single()
		b.handOff(g)
		return resp, groupOutcome{}, err
	}
	c := &groupCall{ctx: ctx, key: key, op: op, size: size, done: make(chan groupOutcome, 1)}
	g.queue = append(g.queue, c)
	g.mu.Unlock()
	var o groupOutcome
	select {
	case o = <-c.done:
	case <-ctx.Done():
		g.mu.Lock()
		if i := slices.Index(g.queue, c); i >= 0 {
			g.queue = slices.Delete(g.queue, i, i+1)
			g.mu.Unlock()
			return nil, groupOutcome{err: notSent(g.op, key, ctx.Err())}, nil
		}
		gb := c.b
		g.mu.Unlock()
		select {
		case o = <-c.done:
		default:
			gb.leave()
			return nil, groupOutcome{err: etc.InFlight(g.op, key, true, ctx.Err())}, nil
		}
	}
	if o.tr == nil && o.err == nil {
		resp, err := single()
		return resp, groupOutcome{}, err
	}
	return nil, o, nil
}

// handOff ends a call's turn in flight: the queue, if any, goes to a
// goroutine that sends it in batches, in that turn.
func (b *Backend) handOff(g *txnGroup) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.queue) == 0 {
		g.inFlight--
		return
	}
	go b.drain(g)
}

// drain sends g's queue in batches until none is left.
func (b *Backend) drain(g *txnGroup) {
	for {
		g.mu.Lock()
		batch := b.takeBatch(g)
		if len(batch) == 0 {
			g.inFlight--
			g.mu.Unlock()
			return
		}
		g.mu.Unlock()
		b.sendBatch(g, batch)
	}
}

// takeBatch takes the next batch from g's queue: in queue order, one call
// per key, within MaxTxnOps and maxBatchBytes. g.mu is held.
func (b *Backend) takeBatch(g *txnGroup) []*groupCall {
	keys := make(map[string]bool)
	var batch, rest []*groupCall
	size := 0
	for _, c := range g.queue {
		if keys[c.key] || len(batch) >= b.maxOps-g.width || size+c.size > maxBatchBytes {
			rest = append(rest, c)
			continue
		}
		keys[c.key] = true
		size += c.size
		batch = append(batch, c)
	}
	g.queue = rest
	if len(batch) > 0 {
		ctx, cancel := context.WithCancel(b.cli.Ctx())
		gb := &groupBatch{ctx: ctx, cancel: cancel, n: len(batch)}
		for _, c := range batch {
			c.b = gb
		}
	}
	return batch
}

// sendBatch sends batch as one transaction of its members' nested
// transactions and hands each member its outcome.
func (b *Backend) sendBatch(g *txnGroup, batch []*groupCall) {
	gb := batch[0].b
	defer gb.cancel()
	if len(batch) == 1 {
		batch[0].done <- groupOutcome{} // alone: the single form costs etcd less
		return
	}
	ops := make([]clientv3.Op, len(batch))
	for i, c := range batch {
		ops[i] = c.op
	}
	resp, err := b.cli.Txn(gb.ctx).Then(ops...).Commit()
	for i, c := range batch {
		switch {
		case err != nil && mayHaveApplied(err):
			c.done <- groupOutcome{err: translate(c.ctx, g.op, c.key, err)}
		case err != nil:
			c.done <- groupOutcome{} // nothing applied: alone
		default:
			tr := resp.Responses[i].GetResponseTxn()
			if !tr.GetSucceeded() {
				c.done <- groupOutcome{} // changed nothing: alone
				continue
			}
			c.done <- groupOutcome{tr: tr, rev: resp.Header.Revision}
		}
	}
}

// mayHaveApplied reports whether a request that failed with err may have
// been applied: not when etcd refused it (see rejected), when it never
// reached a server, or when the server answered with a permanent error.
func mayHaveApplied(err error) bool {
	for _, r := range rejected {
		if errors.Is(err, r) {
			return false
		}
	}
	return !notConnected(err) && transient(err)
}
