package etcd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

var _ sqllock.PermitAcquirer = (*Backend)(nil)

// A semaphore K on etcd (see the package doc): permit i is the lock key
// [sqllock.PermitKey](K, i), with the etcd keys of any lock key (token
// record, holder, release record; never a min hold); the limit is the
// token record of [sqllock.LimitKey](K), whose token is N, written once by
// the first grant and never again, and never held.
//
// A permit acquire is one transaction: the limit compared, then a chain of
// nested transactions, one per candidate permit, each the grant of its
// permit (holder absent, token record as this Backend last saw it) with the
// next candidate in its Else; so exactly one permit is taken, the first
// candidate that is free, and when none is, the chain's last Else reads the
// semaphore's token records and holders (two range reads), at the same
// revision. etcd transactions have no loops: the chain is how "any of N"
// fits in one. The candidates are the permits this Backend last saw free,
// then those it saw held (a release or an expiry since leaves their token
// record as it was, so their grant's compares hold): two more than the
// Backend's permit acquires in flight, and at most what
// [Options.MaxTxnOps] allows (etcd counts each nested level's operations
// against what its parent leaves: two a level). A candidate seen at a
// stale token record (another Backend granted it since) fails its compares
// and passes to the next; when every candidate failed, the state read
// makes the next attempt's candidates right.

// permitChainDepth is how many candidate permits one acquire's chain of
// nested transactions takes under b.maxOps: the creating form's top level
// has three operations (the limit's put and the chain in Then; the limit,
// token records and holders read in Else) and each nested level two (the
// last one's Else is the two reads of the semaphore), and a level is
// checked against what the levels above it leave.
func (b *Backend) permitChainDepth() int { return (b.maxOps-5)/2 + 1 }

// permitSpare is how many candidates a chain takes beyond the permit
// acquires this Backend has in flight (its own included): concurrent
// acquires of one Backend go for the same permits seen free, and each
// needs one more candidate than those before it; a longer chain only
// makes every request larger (in BenchmarkPermitAndSetPair at 1
// goroutine, three runs on a loaded 2-core machine: N = 16 permit pairs at
// 0.98–1.07× a single pair with this, 0.98–1.43× with chains of every
// permit). A chain whose candidates all failed reads the semaphore, and
// the next one's hints are right.
const permitSpare = 2

// permitChainLen is how many candidates the next chain takes: within
// permitChainDepth, those in flight plus b.permitSpare.
func (b *Backend) permitChainLen() int {
	return min(b.permitChainDepth(), int(b.permitsInFlight.Load())+b.permitSpare)
}

// permitBatchDepth is permitChainDepth for a chain that goes in a batch
// of the permits' group commit (b.permits), whose members have what the
// batch's up to MaxTxnOps/2 members leave; 0 when that is too little for
// a chain of one, and permits then always go alone. A longer chain is cut
// to it in a batch, and goes whole when sent alone.
func (b *Backend) permitBatchDepth() int {
	left := b.maxOps - b.maxOps/2
	if left < 5 {
		return 0
	}
	return (left-5)/2 + 1
}

// limitValue is the limit's token record for a limit of n permits.
func limitValue(n int) string {
	v, _ := json.Marshal(tokenRecord{Token: int64(n)}) // cannot fail: an int and a string
	return string(v)
}

// permitRange is the range [start, end) of the etcd keys under key prefix
// p (tokenKey or holderKey) of semaphore sem's permits: every permit key
// and nothing past "sem#permit-9...".
func permitRange(p func(string) string, sem string) (start, end string) {
	return p(sem + "#permit-"), p(sem + "#permit.") // '.' follows '-'

}

// semState is a semaphore's limit record and permits 1..N read at one
// revision (its token records and holders; the permits have no min-hold
// keys, and the release records are not read).
type semState struct {
	limit   int64 // the stored limit; 0: no limit record
	permits []keyState
}

// heldBy is the permit (1..N) held by owner, 0 for none.
func (st semState) heldBy(owner string) int {
	for i, s := range st.permits {
		if s.held() && s.rec.Owner == owner {
			return i + 1
		}
	}
	return 0
}

// semOps are the reads of semaphore sem's limit, token records and
// holders, in the order parseSem expects.
func (b *Backend) semOps(sem string) []clientv3.Op {
	return append([]clientv3.Op{clientv3.OpGet(b.tokenKey(sqllock.LimitKey(sem)))}, b.permitReads(sem)...)
}

// permitReads are the range reads of semaphore sem's token records and
// holders.
func (b *Backend) permitReads(sem string) []clientv3.Op {
	ts, te := permitRange(b.tokenKey, sem)
	hs, he := permitRange(b.holderKey, sem)
	return []clientv3.Op{clientv3.OpGet(ts, clientv3.WithRange(te)), clientv3.OpGet(hs, clientv3.WithRange(he))}
}

// parseSem reads the responses of permitReads (recs, holders) into the
// state of semaphore sem's n permits, and remembers each permit's.
func (b *Backend) parseSem(sem string, n int, limit int64, recs, holders []*mvccpb.KeyValue) (semState, error) {
	st := semState{limit: limit, permits: make([]keyState, n)}
	index := func(etcdKey, prefix string) int {
		s, i, ok := sqllock.ParsePermitKey(strings.TrimPrefix(etcdKey, prefix))
		if !ok || s != sem || i > n {
			return 0 // another key in the range: a permit of a longer semaphore key
		}
		return i
	}
	for _, kv := range recs {
		if i := index(string(kv.Key), b.tokenKey("")); i > 0 {
			s := &st.permits[i-1]
			if err := json.Unmarshal(kv.Value, &s.rec); err != nil {
				return st, fmt.Errorf("sqllock/etcd: %q: corrupt token record %q: %w", kv.Key, kv.Value, err)
			}
			s.recRev = kv.ModRevision
		}
	}
	for _, kv := range holders {
		if i := index(string(kv.Key), b.holderKey("")); i > 0 {
			st.permits[i-1].holder = kv
		}
	}
	for i, s := range st.permits {
		b.remember(sqllock.PermitKey(sem, i+1), s.seen())
	}
	return st, nil
}

// parseLimit is the limit in the limit's token record read by rr (0: none).
func parseLimit(sem string, rr *etcdserverpb.RangeResponse) (int64, error) {
	kvs := rr.GetKvs()
	if len(kvs) == 0 {
		return 0, nil
	}
	var rec tokenRecord
	if err := json.Unmarshal(kvs[0].Value, &rec); err != nil || rec.Token < 1 {
		return 0, fmt.Errorf("sqllock/etcd: semaphore %q: corrupt limit record %q: %v", sem, kvs[0].Value, err)
	}
	return rec.Token, nil
}

// readSem reads semaphore sem (limit n asked) in one read-only
// transaction.
func (b *Backend) readSem(ctx context.Context, sem string, n int) (semState, error) {
	resp, err := b.cli.Txn(ctx).Then(b.semOps(sem)...).Commit()
	if err != nil {
		return semState{}, translate(ctx, outcome.Acquire.Read(), sem, err)
	}
	limit, err := parseLimit(sem, resp.Responses[0].GetResponseRange())
	if err != nil {
		return semState{}, err
	}
	return b.parseSem(sem, n, limit, resp.Responses[1].GetResponseRange().GetKvs(), resp.Responses[2].GetResponseRange().GetKvs())
}

// permitCandidate is a permit one acquire's chain tries: its number and
// the token record this Backend last saw of it.
type permitCandidate struct {
	i    int
	seen seenRecord
}

// permitCandidates are the permits of sem (limit n) that the next chain
// tries, in order: those last seen free, then those seen held, each in
// permit order, none whose token is the largest, at most depth.
func (b *Backend) permitCandidates(sem string, n, depth int) []permitCandidate {
	var free, held []permitCandidate
	for i := 1; i <= n && len(free) < depth; i++ {
		r := b.recall(sqllock.PermitKey(sem, i))
		switch {
		case r.token == math.MaxInt64:
		case r.held:
			if len(held) < depth {
				held = append(held, permitCandidate{i, r})
			}
		default:
			free = append(free, permitCandidate{i, r})
		}
	}
	c := append(free, held...)
	return c[:min(len(c), depth)]
}

// permitChain is the chain of nested transactions that grants the first
// free permit of cands to req on etcd lease id; the last candidate's Else
// reads the semaphore (permitReads), and so does the chain of no
// candidate, alone.
func (b *Backend) permitChain(req sqllock.PermitRequest, cands []permitCandidate, id clientv3.LeaseID) (clientv3.Op, error) {
	if len(cands) == 0 {
		return clientv3.OpTxn(nil, b.permitReads(req.Key), nil), nil
	}
	next := b.permitReads(req.Key)
	var op clientv3.Op
	for j := len(cands) - 1; j >= 0; j-- {
		c := cands[j]
		key := sqllock.PermitKey(req.Key, c.i)
		token := c.seen.token + 1
		rec, err := json.Marshal(tokenRecord{Token: token, Owner: req.Owner, Value: req.Value})
		if err != nil {
			return clientv3.Op{}, err
		}
		op = clientv3.OpTxn(
			[]clientv3.Cmp{
				clientv3.Compare(clientv3.CreateRevision(b.holderKey(key)), "=", 0),
				clientv3.Compare(clientv3.ModRevision(b.tokenKey(key)), "=", c.seen.rev),
			},
			[]clientv3.Op{
				clientv3.OpPut(b.tokenKey(key), string(rec)),
				clientv3.OpPut(b.holderKey(key), tokenString(token), clientv3.WithLease(id)),
			},
			next)
		next = []clientv3.Op{op}
	}
	return op, nil
}

// permitOutcome is what one permit acquire's transaction did: the
// candidate granted (its index in the chain, -1 for none), or the
// semaphore's state as read; or the limit stored when it was not req's.
type permitOutcome struct {
	granted int
	rev     int64
	state   *semState
	limit   int64 // the stored limit when it is not the one asked (0: none stored)
	wrong   bool  // the stored limit is not the one asked
}

// TryAcquirePermit implements [sqllock.PermitAcquirer]: one transaction
// (see above), with the keep-alive of a spare etcd lease sent together
// (one round trip of latency), as [Backend.TryAcquire] does. A refusal
// writes nothing; it costs one time-to-live per holder's etcd lease, asked
// concurrently, for the holders' remaining times. A Backend's first
// acquire of a semaphore that another created, and an acquire whose
// candidates all changed since this Backend saw them, take a second
// transaction. The retry of an acquire whose reply was lost, or a request
// of an owner that this Backend granted a permit of the semaphore to and
// has not seen released, reads the semaphore first: a permit held by the
// owner is granted again, same token, its holder moved onto a new etcd
// lease, and no other one is taken.
func (b *Backend) TryAcquirePermit(ctx context.Context, req sqllock.PermitRequest) (sqllock.Lease, error) {
	return onOwnLeases(ctx, func(ctx context.Context) (sqllock.Lease, error) { return b.tryAcquirePermit(ctx, req) })
}

// tryAcquirePermit is TryAcquirePermit's one attempt (see [onOwnLeases]).
func (b *Backend) tryAcquirePermit(ctx context.Context, req sqllock.PermitRequest) (sqllock.Lease, error) {
	if err := req.Validate(); err != nil {
		return sqllock.Lease{}, err
	}
	if err := ctx.Err(); err != nil {
		return sqllock.Lease{}, notSent(outcome.Acquire, req.Key, err)
	}
	b.permitsInFlight.Add(1)
	defer b.permitsInFlight.Add(-1)
	var st *semState
	if b.maybeHoldsPermit(req.Key, req.Owner) {
		s, err := b.readSem(ctx, req.Key, req.Permits)
		if err != nil {
			return sqllock.Lease{}, err
		}
		st = &s
	}
	grant, err := b.etcdLease(ctx, req.Key, ttlSeconds(req.TTL))
	if err != nil {
		return sqllock.Lease{}, err
	}
	renewed := b.renewSpares(ctx, &grant)
	waited, gone := false, false
	settle := func(key string) (sqllock.Lease, bool) {
		if !waited {
			waited, gone = true, renewed()
		}
		return sqllock.Lease{Key: key, Owner: req.Owner, BackendTime: grant.at, Deadline: grant.at.Add(time.Duration(grant.ttl) * time.Second)}, gone
	}
	// giveBack ends an attempt that put no key on grant.
	giveBack := func() {
		settle("")
		b.putSpare(grant) // none when gone
	}
	for range maxAttempts {
		if st != nil {
			if l, err, done := b.permitFromState(ctx, req, *st, &grant, settle, giveBack); done {
				return l, err
			}
		}
		if err := ctx.Err(); err != nil {
			giveBack()
			return sqllock.Lease{}, notSent(outcome.Acquire, req.Key, err)
		}
		cands := b.permitCandidates(req.Key, req.Permits, b.permitChainLen())
		o, err := b.permitTxn(ctx, req, cands, grant.id)
		if err != nil {
			// The grant may have been applied: a retry reads first.
			b.notePermit(req.Key, req.Owner)
			return sqllock.Lease{}, err
		}
		switch {
		case o.wrong:
			giveBack()
			return sqllock.Lease{}, &sqllock.PermitLimitError{Key: req.Key, Asked: req.Permits, Stored: int(o.limit)}
		case o.granted >= 0:
			c := cands[o.granted]
			key := sqllock.PermitKey(req.Key, c.i)
			lease, gone := settle(key)
			token := c.seen.token + 1
			b.knowLimit(req.Key, req.Permits)
			b.remember(key, seenRecord{rev: o.rev, token: token, held: true, lease: grant.id, deadline: lease.Deadline})
			b.notePermit(req.Key, req.Owner)
			if gone {
				return sqllock.Lease{}, b.leaseGone(key)
			}
			lease.Token, lease.Value = token, cloneValue(req.Value)
			return lease, nil
		}
		st = o.state
	}
	giveBack()
	return sqllock.Lease{}, fmt.Errorf("sqllock/etcd: acquire a permit of %q: %w: the semaphore changed under %d attempts in a row", req.Key, sqllock.ErrUnavailable, maxAttempts)
}

// permitFromState answers req from the semaphore's state st, read at one
// revision, when it decides: the grant again of a permit req's owner
// holds (on etcd lease grant), a limit that differs, a refusal, or an
// exhausted semaphore; done is false when a permit is free (the next
// transaction takes one).
func (b *Backend) permitFromState(ctx context.Context, req sqllock.PermitRequest, st semState, grant *spare,
	settle func(string) (sqllock.Lease, bool), giveBack func()) (l sqllock.Lease, err error, done bool) {
	if st.limit != 0 && st.limit != int64(req.Permits) {
		giveBack()
		return sqllock.Lease{}, &sqllock.PermitLimitError{Key: req.Key, Asked: req.Permits, Stored: int(st.limit)}, true
	}
	if i := st.heldBy(req.Owner); i > 0 {
		key := sqllock.PermitKey(req.Key, i)
		lease, gone := settle(key)
		if gone {
			return sqllock.Lease{}, b.leaseGone(key), true
		}
		l, err := b.regrant(ctx, lease, st.permits[i-1], *grant)
		if _, ok := errors.AsType[*sqllock.HeldError](err); ok {
			// Taken by another since the read: this acquire is settled
			// as not granted; a new attempt decides anew.
			err = fmt.Errorf("sqllock/etcd: acquire a permit of %q: %w: the permit this owner held ended while it was repeated; try again", req.Key, sqllock.ErrUnavailable)
		}
		return l, err, true
	}
	b.forgetPermit(req.Key, req.Owner)
	free, exhausted := false, false
	var holders []sqllock.PermitHolder
	var leases []clientv3.LeaseID
	for i, s := range st.permits {
		switch {
		case s.held():
			holders = append(holders, sqllock.PermitHolder{Key: sqllock.PermitKey(req.Key, i+1), Owner: s.rec.Owner, Token: s.rec.Token, Value: cloneValue(s.rec.Value)})
			leases = append(leases, clientv3.LeaseID(s.holder.Lease))
		case s.rec.Token == math.MaxInt64:
			exhausted = true
		default:
			free = true
		}
	}
	switch {
	case free:
		return sqllock.Lease{}, nil, false
	case exhausted:
		giveBack()
		return sqllock.Lease{}, fmt.Errorf("%w: every free permit of semaphore %q", sqllock.ErrTokenExhausted, req.Key), true
	}
	giveBack()
	// The holders' remaining times: one time-to-live each, at once.
	var wg sync.WaitGroup
	for i := range holders {
		wg.Go(func() { holders[i].Remaining = max(b.remaining(ctx, leases[i]), time.Millisecond) })
	}
	wg.Wait()
	return sqllock.Lease{}, sqllock.NewPermitsHeldError(req.Key, req.Permits, holders), true
}

// permitTxn sends one permit acquire's transaction, with the chain of
// cands on etcd lease id: the known form (the limit compared) when this
// Backend has seen the semaphore's limit, else the creating form, which
// writes the limit record with the grant if there is none and reads it
// (and the semaphore) if there is. Its error is translated.
func (b *Backend) permitTxn(ctx context.Context, req sqllock.PermitRequest, cands []permitCandidate, id clientv3.LeaseID) (permitOutcome, error) {
	chain, err := b.permitChain(req, cands, id)
	if err != nil {
		return permitOutcome{}, err
	}
	limKey := b.tokenKey(sqllock.LimitKey(req.Key))
	known := b.limitKnown(req.Key, req.Permits)
	var resp *clientv3.TxnResponse
	if known {
		limit := clientv3.Compare(clientv3.Value(limKey), "=", limitValue(req.Permits))
		single := func() (*clientv3.TxnResponse, error) {
			return b.cli.Txn(ctx).If(limit).Then(chain).Else(b.semOps(req.Key)...).Commit()
		}
		if depth := b.permitBatchDepth(); depth == 0 {
			resp, err = single()
		} else {
			// Concurrent permit acquires may share a transaction (see
			// txnGroup), one per semaphore in a batch (two chains of one
			// semaphore would write the same candidates): the limit's
			// compare and the chain, nested, at most as long as what a
			// batch leaves it; one whose limit compare fails is sent
			// again alone, with its reads.
			batched, batchedChain := cands[:min(len(cands), depth)], chain
			if len(batched) < len(cands) {
				if batchedChain, err = b.permitChain(req, batched, id); err != nil {
					return permitOutcome{}, err
				}
			}
			size := 64
			for _, c := range batched {
				size += 4*len(b.tokenKey(sqllock.PermitKey(req.Key, c.i))) + len(req.Owner) + len(req.Value) + 64
			}
			var o groupOutcome
			resp, o, err = b.viaGroup(ctx, b.permits, req.Key, clientv3.OpTxn([]clientv3.Cmp{limit}, []clientv3.Op{batchedChain}, nil), size, single)
			switch {
			case o.err != nil:
				return permitOutcome{}, o.err
			case o.tr != nil:
				resp = &clientv3.TxnResponse{Header: &etcdserverpb.ResponseHeader{Revision: o.rev}, Succeeded: true, Responses: o.tr.Responses}
				cands = batched // the chain that went
			}
		}
	} else {
		resp, err = b.cli.Txn(ctx).If(
			clientv3.Compare(clientv3.CreateRevision(limKey), "=", 0),
		).Then(clientv3.OpPut(limKey, limitValue(req.Permits)), chain).Else(b.semOps(req.Key)...).Commit()
	}
	if err != nil {
		return permitOutcome{}, translate(ctx, outcome.Acquire, req.Key, err)
	}
	o := permitOutcome{granted: -1, rev: resp.Header.Revision}
	if !resp.Succeeded {
		// The limit is not the one known (known), or exists (creating).
		limit, err := parseLimit(req.Key, resp.Responses[0].GetResponseRange())
		if err != nil {
			return o, err
		}
		b.forgetLimit(req.Key)
		if limit != 0 && limit != int64(req.Permits) {
			o.limit, o.wrong = limit, true
			return o, nil
		}
		if limit == 0 && !known {
			return o, fmt.Errorf("sqllock/etcd: semaphore %q: the limit record is absent and could not be created", req.Key)
		}
		if limit != 0 {
			b.knowLimit(req.Key, req.Permits)
		}
		st, err := b.parseSem(req.Key, req.Permits, limit, resp.Responses[1].GetResponseRange().GetKvs(), resp.Responses[2].GetResponseRange().GetKvs())
		o.state = &st
		return o, err
	}
	// The chain: the first level that succeeded granted its candidate;
	// the last one's Else (or the chain of no candidate) read the
	// semaphore.
	level := resp.Responses[len(resp.Responses)-1].GetResponseTxn()
	for j := range cands {
		if level.GetSucceeded() {
			o.granted = j
			return o, nil
		}
		if j < len(cands)-1 {
			level = level.GetResponses()[0].GetResponseTxn()
		}
	}
	rs := level.GetResponses()
	if len(rs) != 2 {
		return o, fmt.Errorf("sqllock/etcd: semaphore %q: %d responses to the chain's read, want 2", req.Key, len(rs))
	}
	st, err := b.parseSem(req.Key, req.Permits, int64(req.Permits), rs[0].GetResponseRange().GetKvs(), rs[1].GetResponseRange().GetKvs())
	o.state = &st
	return o, err
}
