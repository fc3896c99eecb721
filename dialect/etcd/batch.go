package etcd

import (
	"context"
	"fmt"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

var _ sqllock.BatchRenewer = (*Backend)(nil)

// batchLease is one distinct lease (key and token) of a batch renewal.
type batchLease struct {
	l    sqllock.Lease
	want int64            // seconds: the longest TTL it was given
	id   clientv3.LeaseID // the etcd lease its holder was seen on; 0: none
	// granted is the TTL (seconds) the keep-alive restarted id with; <= 0:
	// etcd does not know id.
	granted int64
	res     sqllock.RenewResult
}

// TryRenewBatch implements [sqllock.BatchRenewer] in the order TryRenew
// uses, for all the leases at once: one keep-alive per distinct etcd lease
// on the Backend's keep-alive stream, all sent after one send time, then
// one linearizable read-only transaction (split under
// [Options.MaxTxnOps]) that checks, for each lease, that its holder key
// carries its token on the etcd lease kept alive. Leases this Backend has
// not seen the holder's etcd lease of cost one read-only transaction more,
// first. A lease whose TTL is longer than its etcd lease was granted with
// gets a new etcd lease, moved under its holder in one transaction (split
// the same way) that compares the token and the old etcd lease.
func (b *Backend) TryRenewBatch(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
	if err := sqllock.ValidateRenewBatch(reqs); err != nil {
		return nil, err
	}
	if len(reqs) == 0 {
		return nil, nil
	}
	if err := ctx.Err(); err != nil {
		return nil, notSent(outcome.Renew, reqs[0].Lease.Key, err)
	}
	type ref struct {
		key   string
		token int64
	}
	index := make(map[ref]int, len(reqs))
	var leases []*batchLease
	of := make([]int, len(reqs)) // reqs[i] is leases[of[i]]
	for i, r := range reqs {
		k := ref{r.Lease.Key, r.Lease.Token}
		j, ok := index[k]
		if !ok {
			j = len(leases)
			index[k] = j
			leases = append(leases, &batchLease{l: r.Lease, id: b.leaseHint(r.Lease)})
		}
		leases[j].want = max(leases[j].want, ttlSeconds(r.TTL))
		of[i] = j
	}
	if err := b.batchHints(ctx, leases); err != nil {
		return nil, err
	}

	// The keep-alives, one per distinct etcd lease, all after sent.
	var ids []clientv3.LeaseID
	idx := make(map[clientv3.LeaseID]int)
	for _, bl := range leases {
		if _, ok := idx[bl.id]; !ok && bl.id != 0 {
			idx[bl.id] = len(ids)
			ids = append(ids, bl.id)
		}
	}
	sent := time.Now()
	ttls, err := b.ka.many(ctx, ids)
	if err != nil {
		return nil, translate(ctx, outcome.Renew, reqs[0].Lease.Key, err)
	}

	// The check, after the keep-alives.
	states, ok, err := b.batchCheck(ctx, leases)
	if err != nil {
		return nil, err
	}
	var longer []*batchLease
	for i, bl := range leases {
		if bl.id != 0 {
			bl.granted = ttls[idx[bl.id]]
		}
		granted, alive := bl.granted, bl.granted > 0
		switch {
		case ok[i] && alive && granted >= bl.want:
			l := bl.l
			l.BackendTime, l.Deadline = sent, sent.Add(time.Duration(granted)*time.Second)
			b.rememberLease(l.Key, l.Token, bl.id, l.Deadline)
			bl.res.Lease = b.withHold(l)
		case ok[i] && alive:
			longer = append(longer, bl)
		case ok[i]:
			// etcd no longer knows the lease, and its keys go with it.
			bl.res.Err = &sqllock.LostError{Key: bl.l.Key, Token: bl.l.Token, Reason: sqllock.LostExpired}
		default:
			if lost := states[i].sqllock().Loss(bl.l); lost != nil {
				bl.res.Err = lost
				continue
			}
			// Held on another etcd lease than the one kept alive: this
			// lease alone, with TryRenew (which now knows that lease).
			bl.res.Err = fmt.Errorf("sqllock/etcd: renew %q: %w: the holder moved to another etcd lease during the batch; renew it alone", bl.l.Key, sqllock.ErrUnavailable)
		}
	}
	if len(longer) > 0 {
		b.batchLonger(ctx, longer, sent)
	}
	out := make([]sqllock.RenewResult, len(reqs))
	for i := range reqs {
		out[i] = leases[of[i]].res
	}
	return out, nil
}

// nestedWidth is the most operations in any one list (compares, then,
// else) of the nested transactions a batch sends: a key's state read.
const nestedWidth = 3

// chunks calls fn for each run of at most size consecutive elements of n,
// in order, and stops at the first error.
func chunks(n, size int, fn func(lo, hi int) error) error {
	size = max(size, 1)
	for lo := 0; lo < n; lo += size {
		if err := fn(lo, min(lo+size, n)); err != nil {
			return err
		}
	}
	return nil
}

// flatChunk is how many one-operation reads go in one transaction.
func (b *Backend) flatChunk() int { return b.maxOps }

// nestedChunk is how many nested transactions go in one transaction: etcd
// allows a nested transaction the operations its parent leaves
// (--max-txn-ops minus the parent's widest list), so that a parent of n
// nested ones of width w needs n + w <= --max-txn-ops.
func (b *Backend) nestedChunk() int { return b.maxOps - nestedWidth }

// batchHints finds the etcd lease of the holders that this Backend has not
// seen, in read-only transactions of one read per key. A key whose holder
// does not carry the lease's token keeps id 0: the check reports why.
func (b *Backend) batchHints(ctx context.Context, leases []*batchLease) error {
	var unseen []*batchLease
	for _, bl := range leases {
		if bl.id == 0 {
			unseen = append(unseen, bl)
		}
	}
	return chunks(len(unseen), b.flatChunk(), func(lo, hi int) error {
		ops := make([]clientv3.Op, 0, hi-lo)
		for _, bl := range unseen[lo:hi] {
			ops = append(ops, clientv3.OpGet(b.holderKey(bl.l.Key)))
		}
		resp, err := b.cli.Txn(ctx).Then(ops...).Commit()
		if err != nil {
			return translate(ctx, outcome.Renew, unseen[lo].l.Key, err)
		}
		for i, bl := range unseen[lo:hi] {
			kvs := resp.Responses[i].GetResponseRange().GetKvs()
			if len(kvs) == 1 && string(kvs[0].Value) == tokenString(bl.l.Token) {
				bl.id = clientv3.LeaseID(kvs[0].Lease)
			}
		}
		return nil
	})
}

// batchCheck checks, for each lease, that its holder key carries its token
// on etcd lease bl.id: one nested read-only transaction per lease (the
// check of [Backend.check]) in linearizable read-only transactions of at
// most b.nestedChunk() leases. ok[i] reports the check of leases[i]; if it
// failed, states[i] is its key's state.
func (b *Backend) batchCheck(ctx context.Context, leases []*batchLease) ([]keyState, []bool, error) {
	states := make([]keyState, len(leases))
	ok := make([]bool, len(leases))
	err := chunks(len(leases), b.nestedChunk(), func(lo, hi int) error {
		ops := make([]clientv3.Op, 0, hi-lo)
		for _, bl := range leases[lo:hi] {
			ops = append(ops, clientv3.OpTxn(
				[]clientv3.Cmp{b.holds(bl.l), clientv3.Compare(clientv3.LeaseValue(b.holderKey(bl.l.Key)), "=", bl.id)},
				nil, b.readOps(bl.l.Key)))
		}
		resp, err := b.cli.Txn(ctx).Then(ops...).Commit()
		if err != nil {
			return translate(ctx, outcome.Renew, leases[lo].l.Key, err)
		}
		for i, bl := range leases[lo:hi] {
			tr := resp.Responses[i].GetResponseTxn()
			if tr.GetSucceeded() {
				ok[lo+i] = true
				continue
			}
			s, err := parseState(bl.l.Key, tr.GetResponses())
			if err != nil {
				return err
			}
			b.remember(bl.l.Key, s.seen())
			states[lo+i] = s
		}
		return nil
	})
	return states, ok, err
}

// maxGrantsInFlight bounds the lease grants a batch has in flight at once.
const maxGrantsInFlight = 16

// batchLonger renews the leases whose TTL is longer than their etcd lease
// was granted with: a new etcd lease each (granted after sent), moved under
// each holder in transactions of at most b.nestedChunk() nested ones that
// compare the token and the old etcd lease. An element that fails alone
// gets its own error; the old etcd leases, with no key left, are kept for
// reuse.
func (b *Backend) batchLonger(ctx context.Context, longer []*batchLease, sent time.Time) {
	grants := make([]spare, len(longer))
	sem := make(chan struct{}, maxGrantsInFlight)
	var wg sync.WaitGroup
	for i, bl := range longer {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			g, err := b.cli.Grant(ctx, bl.want)
			if err != nil {
				bl.res.Err = translate(ctx, outcome.Grant, bl.l.Key, err)
				return
			}
			grants[i] = spare{id: g.ID, ttl: g.TTL, at: sent, fresh: true}
		})
	}
	wg.Wait()
	var moving []int // indexes into longer with a grant
	for i := range longer {
		if grants[i].id != 0 {
			moving = append(moving, i)
		}
	}
	_ = chunks(len(moving), b.nestedChunk(), func(lo, hi int) error {
		ops := make([]clientv3.Op, 0, hi-lo)
		for _, i := range moving[lo:hi] {
			bl := longer[i]
			ops = append(ops, clientv3.OpTxn(
				[]clientv3.Cmp{b.holds(bl.l), clientv3.Compare(clientv3.LeaseValue(b.holderKey(bl.l.Key)), "=", bl.id)},
				[]clientv3.Op{clientv3.OpPut(b.holderKey(bl.l.Key), tokenString(bl.l.Token), clientv3.WithLease(grants[i].id))},
				b.readOps(bl.l.Key)))
		}
		resp, err := b.cli.Txn(ctx).Then(ops...).Commit()
		for j, i := range moving[lo:hi] {
			bl, g := longer[i], grants[i]
			if err != nil {
				// A renew keeps the token: repeating it is safe, so its
				// unknown outcome is merely unavailable.
				bl.res.Err = translate(ctx, outcome.Renew, bl.l.Key, err)
				continue
			}
			tr := resp.Responses[j].GetResponseTxn()
			if !tr.GetSucceeded() {
				b.putSpare(g) // no key was put on it
				if lost := b.loss(bl.l, tr.GetResponses()); lost != nil {
					bl.res.Err = lost
				} else {
					bl.res.Err = fmt.Errorf("sqllock/etcd: renew %q: %w: the lease changed during the renewal; try again", bl.l.Key, sqllock.ErrUnavailable)
				}
				continue
			}
			// The old etcd lease has no key left; it was kept alive after
			// sent.
			b.putSpare(spare{id: bl.id, ttl: bl.granted, at: sent})
			l := bl.l
			l.BackendTime, l.Deadline = sent, sent.Add(time.Duration(g.ttl)*time.Second)
			b.rememberLease(bl.l.Key, bl.l.Token, g.id, l.Deadline)
			bl.res.Lease = b.withHold(l)
		}
		return nil
	})
}
