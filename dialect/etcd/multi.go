package etcd

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// setCompares is how many compares one key of a set adds to its
// transaction: its holder absent, its min-hold key absent, its token
// record as this Backend last saw it. etcd counts a transaction's
// compares against --max-txn-ops like its operations, so a set takes at
// most [Options.MaxTxnOps] / setCompares keys (42 under etcd's default).
// A key without a token record takes one compare (the record absent) and
// the set one more (the token floor unchanged: see reap.go).
const setCompares = 3

// maxSetKeys is the most keys one set may have on b.
func (b *Backend) maxSetKeys() int { return b.maxOps / setCompares }

// TryAcquireAll implements [sqllock.MultiAcquirer] with one etcd
// transaction: for every key of the set the compares of its grant (as
// [Backend.TryAcquire]'s: holder and min-hold key absent, token record as
// last seen) and its puts (token record, token + 1; holder, on an etcd
// lease of its own), or, when any compare fails, the reads of every key's
// token record, holder and min-hold key, at the same revision. etcd
// applies a transaction whole and at once, and never waits inside one:
// two sets that overlap cannot deadlock, whatever their order. Each key
// gets an etcd lease of its own, as a single acquire would (a spare's
// keep-alive sent with the transaction, one round trip of latency), so
// that each member is renewed, released and lost as any lease. A key seen
// held by the set's owner (a repeat after a lost reply) is granted again
// with its token, its holder moved onto the new etcd lease; a key whose
// token record changed since this Backend saw it costs a second
// transaction. A set of more keys than [Options.MaxTxnOps] / 3 is refused
// before any I/O (matching [sqllock.ErrInvalidKey]).
func (b *Backend) TryAcquireAll(ctx context.Context, req sqllock.MultiAcquireRequest) ([]sqllock.Lease, error) {
	return onOwnLeases(ctx, func(ctx context.Context) ([]sqllock.Lease, error) { return b.tryAcquireAll(ctx, req) })
}

// tryAcquireAll is TryAcquireAll's one attempt (see [onOwnLeases]).
func (b *Backend) tryAcquireAll(ctx context.Context, req sqllock.MultiAcquireRequest) ([]sqllock.Lease, error) {
	if err := req.Validate(); err != nil {
		return nil, err
	}
	if n := len(req.Keys); n > b.maxSetKeys() {
		return nil, fmt.Errorf("%w: a set of %d keys is %d compares in one etcd transaction, more than MaxTxnOps (%d) allows: at most %d keys (raise etcd's --max-txn-ops and Options.MaxTxnOps)",
			sqllock.ErrInvalidKey, n, setCompares*n, b.maxOps, b.maxSetKeys())
	}
	if err := ctx.Err(); err != nil {
		return nil, notSent(outcome.Acquire, req.Keys[0], err)
	}
	keys := sqllock.SortedKeys(req.Keys)
	sps := make([]spare, len(keys))
	giveBack := func() {
		for _, sp := range sps {
			b.putSpare(sp) // none when gone
		}
	}
	for i, k := range keys {
		sp, err := b.etcdLease(ctx, k, ttlSeconds(req.TTL))
		if err != nil {
			giveBack()
			return nil, err
		}
		sps[i] = sp
	}
	ptrs := make([]*spare, len(sps))
	for i := range sps {
		ptrs[i] = &sps[i]
	}
	renewed := b.renewSpares(ctx, ptrs...)
	waited, gone := false, false
	settle := func() bool {
		if !waited {
			waited, gone = true, renewed()
		}
		return gone
	}
	// states: each key's state as the last attempt read it (nil before
	// any read: this Backend's hints decide the compares).
	var states []keyState
	for range maxAttempts {
		if err := ctx.Err(); err != nil {
			settle()
			giveBack()
			return nil, notSent(outcome.Acquire, keys[0], err)
		}
		cmps, puts, tokens, err := b.setTxn(req, keys, states, sps)
		if err != nil {
			return nil, err
		}
		reads := make([]clientv3.Op, 0, 3*len(keys)+1)
		for _, k := range keys {
			// The min-hold key's range holds K's readers' presence keys
			// too (see shared.go): either makes the key taken.
			reads = append(reads, clientv3.OpGet(b.tokenKey(k)), clientv3.OpGet(b.holderKey(k)),
				clientv3.OpGet(b.holdKey(k), clientv3.WithRange(b.holdKey(k)+"\x01"), clientv3.WithLimit(1)))
		}
		reads = append(reads, clientv3.OpGet(b.floorKey()))
		setTxn := func() (*clientv3.TxnResponse, error) {
			return b.cli.Txn(ctx).If(cmps...).Then(puts...).Else(reads...).Commit()
		}
		var resp *clientv3.TxnResponse
		if max(len(cmps), len(puts)) <= b.maxOps/2 {
			// A set that leaves room beside it may share a transaction
			// with others (see txnGroup): its grant as a nested
			// transaction; one whose compares fail is sent again alone,
			// with its reads.
			size := 64
			for _, k := range keys {
				size += 4*len(b.tokenKey(k)) + len(req.Owner) + len(req.Value) + 64
			}
			var o groupOutcome
			resp, o, err = b.viaGroupKeys(ctx, b.sets, keys, clientv3.OpTxn(cmps, puts, nil), size, setTxn)
			switch {
			case o.err != nil:
				return nil, o.err
			case o.tr != nil:
				resp = &clientv3.TxnResponse{Header: &etcdserverpb.ResponseHeader{Revision: o.rev}, Succeeded: true}
			}
		} else {
			resp, err = setTxn()
		}
		if err != nil {
			// Neither etcd lease is kept as a spare: a key may be on it.
			return nil, translate(ctx, outcome.Acquire, keys[0], err)
		}
		if resp.Succeeded {
			return b.setGranted(req, keys, states, sps, tokens, resp.Header.Revision, settle())
		}
		rs := resp.Responses
		_, err = b.noteFloor(rs[len(rs)-1].GetResponseRange().GetKvs())
		if err == nil {
			states, err = b.setStates(keys, rs[:len(rs)-1])
		}
		if err != nil {
			settle()
			giveBack()
			return nil, err
		}
		// The first key, in key order, that refuses the set decides.
		for i, s := range states {
			switch {
			case s.held() && s.rec.Owner == req.Owner:
				continue // a repeat: granted again next
			case s.taken():
				settle()
				giveBack()
				return nil, b.refusal(ctx, keys[i], s)
			case s.rec.Token == math.MaxInt64, s.recRev == 0 && b.floorSeen().value == math.MaxInt64:
				settle()
				giveBack()
				return nil, fmt.Errorf("%w: key %q", sqllock.ErrTokenExhausted, keys[i])
			}
		}
	}
	settle()
	giveBack()
	return nil, fmt.Errorf("sqllock/etcd: acquire a set of %d keys from %q: %w: the keys changed under %d attempts in a row", len(keys), keys[0], sqllock.ErrUnavailable, maxAttempts)
}

// setTxn is the compares and puts of one attempt at the set keys (sorted),
// with each key's state as the last attempt read it (states; nil before
// any read) and its etcd lease (sps), and the token each key gets.
func (b *Backend) setTxn(req sqllock.MultiAcquireRequest, keys []string, states []keyState, sps []spare) ([]clientv3.Cmp, []clientv3.Op, []int64, error) {
	cmps := make([]clientv3.Cmp, 0, setCompares*len(keys))
	puts := make([]clientv3.Op, 0, 2*len(keys))
	tokens := make([]int64, len(keys))
	// A key's first grant (no token record) starts above the floor; the
	// set compares the floor unchanged then (see reap.go).
	floor, firsts := b.floorSeen(), false
	for i, k := range keys {
		var rev, token int64
		var shared bool // the record read was a reader's: compare K free of readers
		if states != nil {
			rev, token = states[i].recRev, states[i].rec.Token
			shared = states[i].seen().shared
			if s := states[i]; s.held() && s.rec.Owner == req.Owner {
				// Held by this very request: the same token, the holder
				// onto the new etcd lease, iff it still holds.
				tokens[i] = token
				cmps = append(cmps,
					clientv3.Compare(clientv3.Value(b.holderKey(k)), "=", tokenString(token)),
					clientv3.Compare(clientv3.ModRevision(b.tokenKey(k)), "=", rev))
				puts = append(puts, clientv3.OpPut(b.holderKey(k), tokenString(token), clientv3.WithLease(sps[i].id)))
				continue
			}
		} else {
			r := b.recall(k)
			rev, token, shared = r.rev, r.token, r.shared
		}
		if rev == 0 {
			token, firsts = max(token, floor.value), true
		}
		if token == math.MaxInt64 {
			// No token to give: a compare that fails makes the attempt a
			// read, which decides.
			cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(b.tokenKey(k)), "<", 0))
			continue
		}
		tokens[i] = token + 1
		rec, err := json.Marshal(tokenRecord{Token: token + 1, Owner: req.Owner, Value: req.Value})
		if err != nil {
			return nil, nil, nil, err
		}
		if rev == 0 {
			// No token record: no holder and no min-hold key either
			// (a grant writes them with the record, and a reap deletes
			// the record only without them), so the record's absence
			// is the one compare, and the set's floor compare the
			// other; a set of n keys stays within 3n compares.
			cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(b.tokenKey(k)), "=", 0))
		} else {
			cmps = append(cmps,
				clientv3.Compare(clientv3.CreateRevision(b.holderKey(k)), "=", 0),
				b.noHold(k, shared),
				clientv3.Compare(clientv3.ModRevision(b.tokenKey(k)), "=", rev))
		}
		puts = append(puts,
			clientv3.OpPut(b.tokenKey(k), string(rec)),
			clientv3.OpPut(b.holderKey(k), tokenString(token+1), clientv3.WithLease(sps[i].id)))
	}
	if firsts {
		cmps = append(cmps, b.firstGrantCmp(floor))
	}
	return cmps, puts, tokens, nil
}

// setGranted is the leases of a set whose transaction succeeded at
// revision rev, in the order of req.Keys; gone: a spare's renewal is not
// known (see [Backend.renewSpares]), and the set is reported not granted.
func (b *Backend) setGranted(req sqllock.MultiAcquireRequest, keys []string, states []keyState, sps []spare, tokens []int64, rev int64, gone bool) ([]sqllock.Lease, error) {
	byKey := make(map[string]sqllock.Lease, len(keys))
	for i, k := range keys {
		sp := sps[i]
		l := sqllock.Lease{Key: k, Token: tokens[i], Owner: req.Owner, Value: cloneValue(req.Value),
			BackendTime: sp.at, Deadline: sp.at.Add(time.Duration(sp.ttl) * time.Second)}
		if states != nil && states[i].held() && states[i].rec.Owner == req.Owner {
			// Granted again: its token record is as read.
			b.remember(k, states[i].seen())
			b.rememberLease(k, l.Token, sp.id, l.Deadline)
			l.Value = cloneValue(states[i].rec.Value)
		} else {
			b.remember(k, seenRecord{rev: rev, token: l.Token, held: true, lease: sp.id, deadline: l.Deadline})
		}
		byKey[k] = l
	}
	if gone {
		// Granted, but on an etcd lease whose renewal is not known: the
		// same owner's repeat gets the set back onto new etcd leases.
		return nil, &spareGoneError{fmt.Sprintf("sqllock/etcd: acquire a set of %d keys from %q: %v: the keep-alive of a member's etcd lease did not confirm it; try again", len(keys), keys[0], sqllock.ErrUnavailable)}
	}
	out := make([]sqllock.Lease, len(req.Keys))
	for i, k := range req.Keys {
		out[i] = byKey[k]
	}
	return out, nil
}

// setStates reads the Else branch of a set's transaction: for each key,
// in order, its token record, holder and min-hold key.
func (b *Backend) setStates(keys []string, rs []*etcdserverpb.ResponseOp) ([]keyState, error) {
	if len(rs) != 3*len(keys) {
		return nil, fmt.Errorf("sqllock/etcd: %d responses to the read of a set of %d keys, want %d", len(rs), len(keys), 3*len(keys))
	}
	states := make([]keyState, len(keys))
	for i, k := range keys {
		s := &states[i]
		if kvs := rs[3*i].GetResponseRange().GetKvs(); len(kvs) > 0 {
			if err := json.Unmarshal(kvs[0].Value, &s.rec); err != nil {
				return nil, fmt.Errorf("sqllock/etcd: %q: corrupt token record %q: %w", k, kvs[0].Value, err)
			}
			s.recRev = kvs[0].ModRevision
		}
		if kvs := rs[3*i+1].GetResponseRange().GetKvs(); len(kvs) > 0 {
			s.holder = kvs[0]
		}
		if kvs := rs[3*i+2].GetResponseRange().GetKvs(); len(kvs) > 0 {
			s.hold = kvs[0]
		}
		b.remember(k, s.seen())
	}
	return states, nil
}
