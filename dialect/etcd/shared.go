package etcd

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// Shared locks (docs/shared-locks.md). A reader of K holds reader slot
// S = K#shared-i as an ordinary lease of S (its token record t/S, its
// holder h/S on an etcd lease of its own, its release record r/S), and
// besides puts a presence key <prefix>m/K\x00i on the same etcd lease: etcd
// deletes both when the reader's lease expires, a release deletes both.
// Keys have no NUL byte, so the range [m/K, m/K\x01) holds exactly K's
// min-hold key and its readers' presence keys, and one compare (that
// range empty) tells an exclusive grant that K has neither: the same
// number of compares as before shared locks. A reader's grant writes K's
// token record too (token + 1, no owner), so every token of K, shared or
// exclusive, comes from K's one counter. A waiting writer's mark is
// <prefix>w/K (the writer's owner), on an etcd lease of its own whose TTL
// is the writer's: a crashed writer's mark ends with it.

func (b *Backend) markKey(k string) string { return b.prefix + "w/" + k }

// presenceKey is the presence key of reader slot i of K.
func (b *Backend) presenceKey(k string, i int) string {
	return b.holdKey(k) + "\x00" + strconv.Itoa(i)
}

// presenceOf is the presence key of slot key s, "" when s is not a
// reader slot.
func (b *Backend) presenceOf(s string) string {
	if k, i, ok := sqllock.ParseSharedKey(s); ok {
		return b.presenceKey(k, i)
	}
	return ""
}

// noHoldNorReaders compares K free of a min-hold key and of readers.
func (b *Backend) noHoldNorReaders(k string) clientv3.Cmp {
	return clientv3.Compare(clientv3.CreateRevision(b.holdKey(k)), "=", 0).WithRange(b.holdKey(k) + "\x01")
}

// noHold is the exclusive grant's compare of K's min-hold key absent,
// for a grant that compares K's token record at a revision whose record
// was written by a reader's grant (shared) or not. Not: no reader can
// hold K, since a reader's grant rewrites K's token record and an
// exclusive grant over a reader's record compares K free of readers
// (by induction from the first record, or none: a reader writes one, a
// reap deletes it only without readers), so the plain point compare
// suffices; an etcd range compare in every plain acquire cost about 13%
// of its pairs per second. Shared: noHoldNorReaders.
func (b *Backend) noHold(k string, shared bool) clientv3.Cmp {
	if shared {
		return b.noHoldNorReaders(k)
	}
	return clientv3.Compare(clientv3.CreateRevision(b.holdKey(k)), "=", 0)
}

// slotPrefix is the start of the etcd keys of K's reader slots under p.
func slotPrefix(p func(string) string, k string) string { return p(k + "#shared-") }

// readerOps are what an exclusive grant's Else reads of K's readers: the
// slots' holders, and the mark.
func (b *Backend) readerOps(k string) []clientv3.Op {
	return []clientv3.Op{
		clientv3.OpGet(slotPrefix(b.holderKey, k), clientv3.WithPrefix()),
		clientv3.OpGet(b.markKey(k)),
	}
}

// sharedOps read what a shared grant decides on: K's token record,
// holder and min-hold key, the mark, the slots' token records and
// holders, and the floor.
func (b *Backend) sharedOps(k string) []clientv3.Op {
	return []clientv3.Op{
		clientv3.OpGet(b.tokenKey(k)),
		clientv3.OpGet(b.holderKey(k)),
		clientv3.OpGet(b.holdKey(k)),
		clientv3.OpGet(b.markKey(k)),
		clientv3.OpGet(slotPrefix(b.tokenKey, k), clientv3.WithPrefix()),
		clientv3.OpGet(slotPrefix(b.holderKey, k), clientv3.WithPrefix()),
		clientv3.OpGet(b.floorKey()),
	}
}

// sharedState is K's state as a shared grant reads it.
type sharedState struct {
	k     keyState // t/K, h/K, m/K (no release record)
	mark  *mvccpb.KeyValue
	slots map[int]keyState // by slot number: token record and holder
	top   int              // the highest slot number with a token record
	floor floorHint
}

// readers is the slots held.
func (s sharedState) readers() int {
	n := 0
	for _, sl := range s.slots {
		if sl.held() {
			n++
		}
	}
	return n
}

func (b *Backend) parseShared(k string, rs []*etcdserverpb.ResponseOp) (sharedState, error) {
	st := sharedState{slots: make(map[int]keyState)}
	if len(rs) != 7 {
		return st, fmt.Errorf("sqllock/etcd: %q: %d responses to a shared read, want 7", k, len(rs))
	}
	if kvs := rs[0].GetResponseRange().GetKvs(); len(kvs) > 0 {
		if err := json.Unmarshal(kvs[0].Value, &st.k.rec); err != nil {
			return st, fmt.Errorf("sqllock/etcd: %q: corrupt token record %q: %w", k, kvs[0].Value, err)
		}
		st.k.recRev = kvs[0].ModRevision
	}
	if kvs := rs[1].GetResponseRange().GetKvs(); len(kvs) > 0 {
		st.k.holder = kvs[0]
	}
	if kvs := rs[2].GetResponseRange().GetKvs(); len(kvs) > 0 {
		st.k.hold = kvs[0]
	}
	if kvs := rs[3].GetResponseRange().GetKvs(); len(kvs) > 0 {
		st.mark = kvs[0]
	}
	for _, kv := range rs[4].GetResponseRange().GetKvs() {
		_, i, ok := sqllock.ParseSharedKey(strings.TrimPrefix(string(kv.Key), b.tokenKey("")))
		if !ok {
			continue
		}
		sl := st.slots[i]
		if err := json.Unmarshal(kv.Value, &sl.rec); err != nil {
			return st, fmt.Errorf("sqllock/etcd: %q: corrupt token record %q: %w", kv.Key, kv.Value, err)
		}
		sl.recRev = kv.ModRevision
		st.slots[i] = sl
		st.top = max(st.top, i)
	}
	for _, kv := range rs[5].GetResponseRange().GetKvs() {
		if _, i, ok := sqllock.ParseSharedKey(strings.TrimPrefix(string(kv.Key), b.holderKey(""))); ok {
			sl := st.slots[i]
			sl.holder = kv
			st.slots[i] = sl
		}
	}
	f, err := b.noteFloor(rs[6].GetResponseRange().GetKvs())
	st.floor = f
	return st, err
}

// maxSharedAttempts bounds a shared grant's transactions: readers of one
// key contend on its token record, each grant changing it.
const maxSharedAttempts = 64

// tryAcquireShared grants a shared request: one read, then one
// transaction per attempt (its Else reads again), with the spare's
// keep-alive sent beside the first.
func (b *Backend) tryAcquireShared(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	if err := req.ValidateShared(); err != nil {
		return sqllock.Lease{}, err
	}
	if err := ctx.Err(); err != nil {
		return sqllock.Lease{}, notSent(outcome.Acquire, req.Key, err)
	}
	resp, err := b.cli.Txn(ctx).Then(b.sharedOps(req.Key)...).Commit()
	if err != nil {
		return sqllock.Lease{}, translate(ctx, outcome.Acquire.Read(), req.Key, err)
	}
	st, err := b.parseShared(req.Key, resp.Responses)
	if err != nil {
		return sqllock.Lease{}, err
	}
	if he := b.sharedRefusal(ctx, req.Key, st); he != nil {
		return sqllock.Lease{}, he
	}
	grant, _, err := b.takeLeases(ctx, req)
	if err != nil {
		return sqllock.Lease{}, err
	}
	renewed := b.renewSpares(ctx, &grant)
	waited, gone := false, false
	settle := func() bool {
		if !waited {
			waited, gone = true, renewed()
		}
		return gone
	}
	giveUp := func(err error) (sqllock.Lease, error) {
		if !settle() {
			b.putSpare(grant)
		}
		return sqllock.Lease{}, err
	}
	lease := func(key string, token int64, value []byte) sqllock.Lease {
		return sqllock.Lease{Key: key, Token: token, Owner: req.Owner, Value: cloneValue(value),
			BackendTime: grant.at, Deadline: grant.at.Add(time.Duration(grant.ttl) * time.Second)}
	}
	for range maxSharedAttempts {
		if he := b.sharedRefusal(ctx, req.Key, st); he != nil {
			return giveUp(he)
		}
		// A repeat of this very acquire (its reply lost): the same grant.
		slot := 0
		for i := 1; i <= st.top; i++ {
			if sl := st.slots[i]; sl.held() && sl.rec.Owner == req.Owner {
				if settle() {
					return sqllock.Lease{}, b.leaseGone(req.Key)
				}
				return b.regrant(ctx, lease(sqllock.SharedKey(req.Key, i), 0, nil), sl, grant)
			}
		}
		for i := 1; i <= st.top+1 && slot == 0; i++ {
			if sl := st.slots[i]; sl.holder == nil {
				slot = i
			}
		}
		if slot == 0 || slot > sqllock.MaxShared {
			return giveUp(&sqllock.HeldError{Key: req.Key, Token: st.k.rec.Token, Shared: st.readers(),
				Remaining: b.readersRemaining(ctx, st)})
		}
		top := st.k.rec.Token
		first := st.k.recRev == 0
		if first {
			top = max(top, st.floor.value)
		}
		if top == math.MaxInt64 {
			return giveUp(fmt.Errorf("%w: key %q", sqllock.ErrTokenExhausted, req.Key))
		}
		token := top + 1
		sk := sqllock.SharedKey(req.Key, slot)
		krec, _ := json.Marshal(tokenRecord{Token: token}) // cannot fail: an int
		srec, err := json.Marshal(tokenRecord{Token: token, Owner: req.Owner, Value: req.Value})
		if err != nil {
			return giveUp(err)
		}
		cmps := []clientv3.Cmp{
			clientv3.Compare(clientv3.ModRevision(b.tokenKey(req.Key)), "=", st.k.recRev),
			clientv3.Compare(clientv3.CreateRevision(b.holderKey(req.Key)), "=", 0),
			clientv3.Compare(clientv3.CreateRevision(b.holdKey(req.Key)), "=", 0),
			clientv3.Compare(clientv3.CreateRevision(b.markKey(req.Key)), "=", 0),
			clientv3.Compare(clientv3.CreateRevision(b.holderKey(sk)), "=", 0),
			clientv3.Compare(clientv3.ModRevision(b.tokenKey(sk)), "=", st.slots[slot].recRev),
		}
		if first {
			cmps = append(cmps, b.firstGrantCmp(st.floor))
		}
		if err := ctx.Err(); err != nil {
			return giveUp(notSent(outcome.Acquire, req.Key, err))
		}
		if b.beforeGrant != nil {
			b.beforeGrant(req.Key)
		}
		resp, err := b.cli.Txn(ctx).If(cmps...).Then(
			clientv3.OpPut(b.tokenKey(req.Key), string(krec)),
			clientv3.OpPut(b.tokenKey(sk), string(srec)),
			clientv3.OpPut(b.holderKey(sk), tokenString(token), clientv3.WithLease(grant.id)),
			clientv3.OpPut(b.presenceKey(req.Key, slot), tokenString(token), clientv3.WithLease(grant.id)),
		).Else(b.sharedOps(req.Key)...).Commit()
		if err != nil {
			return sqllock.Lease{}, translate(ctx, outcome.Acquire, req.Key, err)
		}
		if resp.Succeeded {
			l := lease(sk, token, req.Value)
			b.remember(req.Key, seenRecord{rev: resp.Header.Revision, token: token, shared: true})
			b.remember(sk, seenRecord{rev: resp.Header.Revision, token: token, held: true, lease: grant.id, deadline: l.Deadline})
			if settle() {
				return sqllock.Lease{}, b.leaseGone(req.Key)
			}
			return l, nil
		}
		if st, err = b.parseShared(req.Key, resp.Responses); err != nil {
			return giveUp(err)
		}
	}
	return giveUp(fmt.Errorf("sqllock/etcd: acquire %q shared: %w: the key changed under %d attempts in a row", req.Key, sqllock.ErrUnavailable, maxSharedAttempts))
}

// sharedRefusal is why st refuses a shared grant: an exclusive holder (or
// a min hold), or a waiting writer's live mark; nil when it does not.
func (b *Backend) sharedRefusal(ctx context.Context, key string, st sharedState) *sqllock.HeldError {
	switch {
	case st.k.taken():
		he := b.refusal(ctx, key, st.k).(*sqllock.HeldError)
		he.WaitingWriter = markOwner(st.mark)
		return he
	case st.mark != nil:
		he := &sqllock.HeldError{Key: key, WaitingWriter: markOwner(st.mark), Remaining: b.remaining(ctx, clientv3.LeaseID(st.mark.Lease))}
		if n := st.readers(); n > 0 {
			he.Shared, he.Token = n, st.k.rec.Token
		}
		return he
	}
	return nil
}

func markOwner(kv *mvccpb.KeyValue) string {
	if kv == nil {
		return ""
	}
	return string(kv.Value)
}

// readersRemaining is the time left to K's last reader: the longest of
// its readers' etcd leases (one time-to-live each, at most a few).
func (b *Backend) readersRemaining(ctx context.Context, st sharedState) time.Duration {
	var d time.Duration
	seen := map[int64]bool{}
	for _, sl := range st.slots {
		if sl.held() && !seen[sl.holder.Lease] && len(seen) < 8 {
			seen[sl.holder.Lease] = true
			d = max(d, b.remaining(ctx, clientv3.LeaseID(sl.holder.Lease)))
		}
	}
	return max(d, time.Millisecond)
}

// readersRefusal is the refusal of an exclusive request by K's readers,
// from an exclusive grant's Else: the slots' holders rs[0] and the mark
// rs[1]; nil when K has no reader.
func (b *Backend) readersRefusal(ctx context.Context, key string, s keyState, rs []*etcdserverpb.ResponseOp) *sqllock.HeldError {
	var mark *mvccpb.KeyValue
	if kvs := rs[1].GetResponseRange().GetKvs(); len(kvs) > 0 {
		mark = kvs[0]
	}
	st := sharedState{k: s, mark: mark, slots: make(map[int]keyState)}
	for _, kv := range rs[0].GetResponseRange().GetKvs() {
		if _, i, ok := sqllock.ParseSharedKey(strings.TrimPrefix(string(kv.Key), b.holderKey(""))); ok {
			st.slots[i] = keyState{holder: kv, rec: tokenRecord{Token: mustToken(kv.Value)}}
		}
	}
	n := st.readers()
	if n == 0 {
		return nil
	}
	return &sqllock.HeldError{Key: key, Token: s.rec.Token, Shared: n, Remaining: b.readersRemaining(ctx, st), WaitingWriter: markOwner(mark)}
}

// mustToken is a holder's value as a token (0 if it is not one).
func mustToken(v []byte) int64 {
	t, _ := strconv.ParseInt(string(v), 10, 64)
	return t
}

// markOps is the Else operation of a waiting writer's refused grant
// (owner, on etcd lease id): its mark, put when none is there or when it
// is the writer's own (onto id, so that it lasts the writer's TTL from
// this attempt); another writer's live mark stays.
func (b *Backend) markOps(key, owner string, id clientv3.LeaseID) clientv3.Op {
	put := []clientv3.Op{clientv3.OpPut(b.markKey(key), owner, clientv3.WithLease(id))}
	return clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(b.markKey(key)), "=", 0)}, put,
		[]clientv3.Op{clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.Value(b.markKey(key)), "=", owner)}, put, nil)})
}

// markSet reports whether markOps' response r put the mark.
func markSet(r *etcdserverpb.ResponseOp) bool {
	tr := r.GetResponseTxn()
	if tr.GetSucceeded() {
		return true
	}
	rs := tr.GetResponses()
	return len(rs) == 1 && rs[0].GetResponseTxn().GetSucceeded()
}

// unmarkOp ends owner's own mark on key, in its grant.
func (b *Backend) unmarkOp(key, owner string) clientv3.Op {
	return clientv3.OpTxn([]clientv3.Cmp{clientv3.Compare(clientv3.Value(b.markKey(key)), "=", owner)},
		[]clientv3.Op{clientv3.OpDelete(b.markKey(key))}, nil)
}

// releaseReaders is a forced release of K held shared at token l.Token
// (its latest reader's) by l's owner, state s: every reader of K ends at
// once, recorded released by l's owner, in one transaction that compares
// K's token record and each reader's holder unchanged. Its error is nil
// when done (or when K is no longer held at l.Token), else why not.
func (b *Backend) releaseReaders(ctx context.Context, l sqllock.Lease, s keyState) error {
	for range maxAttempts {
		resp, err := b.cli.Txn(ctx).Then(b.sharedOps(l.Key)...).Commit()
		if err != nil {
			return translate(ctx, outcome.Release, l.Key, err)
		}
		st, err := b.parseShared(l.Key, resp.Responses)
		if err != nil {
			return err
		}
		if st.k.recRev != s.recRev || st.readers() == 0 {
			return nil // K changed: no longer held shared at l.Token
		}
		cmps := []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(b.tokenKey(l.Key)), "=", st.k.recRev)}
		ops := []clientv3.Op{clientv3.OpDelete(b.holdKey(l.Key)+"\x00", clientv3.WithRange(b.holdKey(l.Key)+"\x01"))}
		for i, sl := range st.slots {
			if !sl.held() {
				continue
			}
			sk := sqllock.SharedKey(l.Key, i)
			rel, _ := json.Marshal(releaseRecord{Token: sl.rec.Token, By: l.Owner}) // cannot fail
			cmps = append(cmps, clientv3.Compare(clientv3.ModRevision(b.holderKey(sk)), "=", sl.holder.ModRevision))
			ops = append(ops, clientv3.OpDelete(b.holderKey(sk)), clientv3.OpPut(b.releaseKey(sk), string(rel)))
		}
		if len(cmps) > b.maxOps || len(ops) > b.maxOps {
			return fmt.Errorf("sqllock/etcd: release %q: %w: %d readers are more than one etcd transaction (MaxTxnOps %d) ends at once", l.Key, sqllock.ErrUnavailable, st.readers(), b.maxOps)
		}
		resp, err = b.cli.Txn(ctx).If(cmps...).Then(ops...).Commit()
		if err != nil {
			return translate(ctx, outcome.Release, l.Key, err)
		}
		if resp.Succeeded {
			return nil
		}
	}
	return fmt.Errorf("sqllock/etcd: release %q: %w: its readers changed under %d attempts in a row", l.Key, sqllock.ErrUnavailable, maxAttempts)
}

// markOf is the mark read by readerOps' responses rs.
func markOf(rs []*etcdserverpb.ResponseOp) *mvccpb.KeyValue {
	if kvs := rs[1].GetResponseRange().GetKvs(); len(kvs) > 0 {
		return kvs[0]
	}
	return nil
}

// withPresence adds to ops, for a reader slot key, the put of its
// presence key with token on etcd lease id (a holder moved onto id takes
// its presence key along).
func (b *Backend) withPresence(ops []clientv3.Op, key string, token int64, id clientv3.LeaseID) []clientv3.Op {
	if p := b.presenceOf(key); p != "" {
		ops = append(ops, clientv3.OpPut(p, tokenString(token), clientv3.WithLease(id)))
	}
	return ops
}

// withoutPresence adds to a release's ops, for a reader slot key, the
// delete of its presence key.
func (b *Backend) withoutPresence(ops []clientv3.Op, key string) []clientv3.Op {
	if p := b.presenceOf(key); p != "" {
		ops = append(ops, clientv3.OpDelete(p))
	}
	return ops
}
