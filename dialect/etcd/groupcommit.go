package etcd

import (
	"context"
	"errors"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/internal/groupcommit"
	"github.com/ashlock/ashlock/internal/outcome"
)

// Group commit: concurrent grants (TryAcquire's first transaction, without
// a min hold) of one Backend share one transaction, one raft entry, as
// nested transactions, one per grant; so do concurrent flat releases (see
// releaseTxn), and concurrent sets' grants (TryAcquireAll's transaction,
// of sets at most MaxTxnOps/2 operations wide; no two sets of a batch
// share a key), each in transactions of their own.
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
//
// The queue (who goes alone, who waits, the hand-off, a member that
// leaves) is internal/groupcommit's, which PostgreSQL and MariaDB share;
// this file is what etcd sends for a batch and how it reads the reply.
type txnGroup = groupcommit.Queue[clientv3.Op, groupOutcome]

// newGroup returns the group of operation o, whose member's nested
// transaction counts width operations against MaxTxnOps.
func (b *Backend) newGroup(o outcome.Op, width int) *txnGroup {
	return &txnGroup{Limit: groupInFlight, MaxMembers: b.maxOps - width, MaxSize: maxBatchBytes, Parent: b.cli.Ctx,
		Send:     func(ctx context.Context, batch []*groupMember) { sendBatch(ctx, b.cli, o, batch) },
		NotSent:  func(key string, err error) error { return notSent(o, key, err) },
		InFlight: func(key string, err error) error { return etc.InFlight(o, key, true, err) }}
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

// groupMember is one queued call: its nested transaction.
type groupMember = groupcommit.Member[clientv3.Op, groupOutcome]

// groupOutcome is what a queued call learns of its batch: an error
// (translated, from viaGroup), or its nested transaction's response when
// it succeeded, with the batch's revision; neither: it was sent alone.
type groupOutcome struct {
	err error
	tr  *etcdserverpb.TxnResponse
	rev int64
}

// viaGroup sends a call of g's kind for key: single, its single
// transaction, when sent alone (its response or error, untranslated,
// returned), else op, its nested form, about size bytes of request, in a
// batch (the batch's outcome returned, with a nil error).
func (b *Backend) viaGroup(ctx context.Context, g *txnGroup, key string, op clientv3.Op, size int, single func() (*clientv3.TxnResponse, error)) (*clientv3.TxnResponse, groupOutcome, error) {
	return b.viaGroupKeys(ctx, g, []string{key}, op, size, single)
}

// viaGroupKeys is viaGroup for a call of several keys (a set): its batch
// carries no other call of any of them.
func (b *Backend) viaGroupKeys(ctx context.Context, g *txnGroup, keys []string, op clientv3.Op, size int, single func() (*clientv3.TxnResponse, error)) (*clientv3.TxnResponse, groupOutcome, error) {
	var resp *clientv3.TxnResponse
	var err error
	o, gerr := g.DoKeys(ctx, keys, size, op, func(context.Context) (groupOutcome, error) {
		resp, err = single()
		return groupOutcome{}, nil
	})
	switch {
	case gerr != nil:
		return nil, groupOutcome{err: gerr}, nil
	case o.tr != nil:
		return nil, o, nil
	}
	return resp, groupOutcome{}, err
}

// sendBatch sends batch (at least two calls) as one transaction of its
// members' nested transactions, of operation o, and sets each member's
// outcome.
func sendBatch(ctx context.Context, cli *clientv3.Client, o outcome.Op, batch []*groupMember) {
	ops := make([]clientv3.Op, len(batch))
	for i, m := range batch {
		ops[i] = m.Req
	}
	resp, err := cli.Txn(ctx).Then(ops...).Commit()
	for i, m := range batch {
		switch {
		case err != nil && mayHaveApplied(err):
			m.Err = translate(m.Ctx, o, m.Key, err)
		case err != nil:
			m.Err = groupcommit.ErrAlone // nothing applied: alone
		default:
			tr := resp.Responses[i].GetResponseTxn()
			if !tr.GetSucceeded() {
				m.Err = groupcommit.ErrAlone // changed nothing: alone
				continue
			}
			m.Res = groupOutcome{tr: tr, rev: resp.Header.Revision}
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
