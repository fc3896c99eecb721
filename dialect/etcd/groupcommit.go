package etcd

import (
	"context"
	"errors"
	"slices"
	"sync"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// Group commit of releases: concurrent flat releases (see releaseTxn) of
// one Backend share one transaction, one raft entry, as nested
// transactions, one per release.
//
// It adds no latency to a Backend that is not busy: a release is sent at
// once, alone, while fewer than releaseInFlight are in flight. Only one
// that comes while that many are in flight waits in a queue; the sender
// of the next one to finish hands the queue to a goroutine that sends it
// in batches until it is empty. The rules a batch keeps:
//   - one release per key in a batch: a second one for a key stays queued
//     for the next batch;
//   - at most [Options.MaxTxnOps] − 2 releases (etcd counts a nested
//     transaction's operations against what its parent leaves), and at
//     most maxBatchBytes of request;
//   - a release whose nested transaction failed (not held by its lease,
//     or a min-hold key there) changed nothing, and is sent again alone:
//     it gets the single release's answer;
//   - a release whose context ends while it is queued leaves the queue,
//     and nothing of it is ever sent; one whose context ends while its
//     batch is in flight returns at once, in flight as the single release
//     would, and the batch goes on for the others (it is cancelled only
//     when every member has left);
//   - a batch whose reply is lost (it may have been applied) makes every
//     member's outcome unknown, as the single release's lost reply; a
//     batch that etcd refused, or that never reached it, applied nothing:
//     each member is sent again alone.
type relGroup struct {
	mu       sync.Mutex // guards inFlight, queue
	inFlight int
	queue    []*relCall
}

// releaseInFlight is how many releases (single or batches) a Backend
// sends concurrently before it queues further ones for a batch: 4, as the
// PostgreSQL backend's group commit, whose measurements found that with 2
// a third caller at 4 goroutines waits where it could have gone at once
// (not told apart for etcd yet: the runs at hand varied by ±15%).
const releaseInFlight = 4

// maxBatchBytes bounds a batch's request: under etcd's default
// --max-request-bytes (1.5 MiB), with room for the envelope.
const maxBatchBytes = 1 << 20

// relCall is one queued release.
type relCall struct {
	ctx  context.Context
	l    sqllock.Lease
	rel  string
	done chan relOutcome // buffered: the batch never waits for a caller gone
	b    *relBatch       // set when taken into a batch, under relGroup.mu
}

// relBatch is a batch in flight: its context, cancelled when every
// member has left.
type relBatch struct {
	ctx    context.Context
	cancel context.CancelFunc
	mu     sync.Mutex // guards left
	left   int
	n      int
}

func (rb *relBatch) leave() {
	rb.mu.Lock()
	defer rb.mu.Unlock()
	rb.left++
	if rb.left == rb.n {
		rb.cancel()
	}
}

// relOutcome is what a queued release learns of its batch.
type relOutcome struct {
	err  error              // the release's error, translated: settled
	ok   bool               // released by its batch
	prev []*mvccpb.KeyValue // the holder key's previous value, when ok
	// Neither: not settled; send it alone.
}

// releaseFlat sends l's flat release, alone or in a batch (see relGroup):
// the single transaction's response or error (untranslated) when sent
// alone, else the batch's outcome for it.
func (b *Backend) releaseFlat(ctx context.Context, l sqllock.Lease, rel string) (*clientv3.TxnResponse, error, relOutcome) {
	g := &b.rel
	g.mu.Lock()
	if g.inFlight < releaseInFlight {
		g.inFlight++
		g.mu.Unlock()
		resp, err := b.releaseTxn(ctx, l, rel, true)
		b.handOff()
		return resp, err, relOutcome{}
	}
	c := &relCall{ctx: ctx, l: l, rel: rel, done: make(chan relOutcome, 1)}
	g.queue = append(g.queue, c)
	g.mu.Unlock()
	var o relOutcome
	select {
	case o = <-c.done:
	case <-ctx.Done():
		g.mu.Lock()
		if i := slices.Index(g.queue, c); i >= 0 {
			g.queue = slices.Delete(g.queue, i, i+1)
			g.mu.Unlock()
			return nil, nil, relOutcome{err: notSent(outcome.Release, l.Key, ctx.Err())}
		}
		rb := c.b
		g.mu.Unlock()
		select {
		case o = <-c.done:
		default:
			rb.leave()
			return nil, nil, relOutcome{err: etc.InFlight(outcome.Release, l.Key, true, ctx.Err())}
		}
	}
	if !o.ok && o.err == nil {
		resp, err := b.releaseTxn(ctx, l, rel, true)
		return resp, err, relOutcome{}
	}
	return nil, nil, o
}

// handOff ends a release's turn in flight: the queue, if any, goes to a
// goroutine that sends it in batches, in that turn.
func (b *Backend) handOff() {
	g := &b.rel
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.queue) == 0 {
		g.inFlight--
		return
	}
	go b.drainReleases()
}

// drainReleases sends the queued releases in batches until none is left.
func (b *Backend) drainReleases() {
	g := &b.rel
	for {
		g.mu.Lock()
		batch := b.takeBatch()
		if len(batch) == 0 {
			g.inFlight--
			g.mu.Unlock()
			return
		}
		g.mu.Unlock()
		b.sendReleases(batch)
	}
}

// takeBatch takes the next batch from the queue: in queue order, one
// release per key, at most nestedChunk releases and maxBatchBytes.
// relGroup.mu is held.
func (b *Backend) takeBatch() []*relCall {
	g := &b.rel
	keys := make(map[string]bool)
	var batch, rest []*relCall
	size := 0
	for _, c := range g.queue {
		n := 4*len(b.holderKey(c.l.Key)) + len(c.rel) + 64
		if keys[c.l.Key] || len(batch) >= b.maxOps-2 || size+n > maxBatchBytes {
			rest = append(rest, c)
			continue
		}
		keys[c.l.Key] = true
		size += n
		batch = append(batch, c)
	}
	g.queue = rest
	if len(batch) > 0 {
		ctx, cancel := context.WithCancel(b.cli.Ctx())
		rb := &relBatch{ctx: ctx, cancel: cancel, n: len(batch)}
		for _, c := range batch {
			c.b = rb
		}
	}
	return batch
}

// sendReleases sends batch as one transaction of nested flat releases
// and hands each member its outcome.
func (b *Backend) sendReleases(batch []*relCall) {
	rb := batch[0].b
	defer rb.cancel()
	if len(batch) == 1 {
		batch[0].done <- relOutcome{} // alone: the single form costs etcd less
		return
	}
	ops := make([]clientv3.Op, len(batch))
	for i, c := range batch {
		ops[i] = clientv3.OpTxn(
			[]clientv3.Cmp{b.holds(c.l), clientv3.Compare(clientv3.CreateRevision(b.holdKey(c.l.Key)), "=", 0)},
			[]clientv3.Op{
				clientv3.OpDelete(b.holderKey(c.l.Key), clientv3.WithPrevKV()),
				clientv3.OpPut(b.releaseKey(c.l.Key), c.rel),
			}, nil)
	}
	resp, err := b.cli.Txn(rb.ctx).Then(ops...).Commit()
	for i, c := range batch {
		switch {
		case err != nil && mayHaveApplied(err):
			c.done <- relOutcome{err: translate(c.ctx, outcome.Release, c.l.Key, err)}
		case err != nil:
			c.done <- relOutcome{} // nothing applied: alone
		default:
			tr := resp.Responses[i].GetResponseTxn()
			if !tr.GetSucceeded() {
				c.done <- relOutcome{} // changed nothing: alone
				continue
			}
			c.done <- relOutcome{ok: true, prev: tr.GetResponses()[0].GetResponseDeleteRange().GetPrevKvs()}
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
