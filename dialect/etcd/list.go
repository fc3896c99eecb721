package etcd

import (
	"context"
	"encoding/json"
	"fmt"
	"sort"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// List implements [sqllock.Backend]: one read-only transaction reads the
// four key ranges at one revision. A held key whose lease this Backend
// granted or renewed last reports the Deadline it reported then; any other
// held key's remaining time is one more round trip (etcd's lease
// time-to-live, in whole seconds). A key in its min hold is held, by the
// grant's owner, until the later of the holder's end and the hold's (the
// hold's end: the one this Backend reported at the grant, else one more
// time-to-live).
func (b *Backend) List(ctx context.Context, prefix string) ([]sqllock.LockInfo, error) {
	if err := sqllock.ValidatePrefix(prefix); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, notSent(outcome.List, prefix, err)
	}
	resp, err := b.cli.Txn(ctx).Then(
		clientv3.OpGet(b.tokenKey(prefix), clientv3.WithPrefix()),
		clientv3.OpGet(b.holderKey(prefix), clientv3.WithPrefix()),
		clientv3.OpGet(b.releaseKey(prefix), clientv3.WithPrefix()),
		clientv3.OpGet(b.holdKey(prefix), clientv3.WithPrefix()),
		clientv3.OpGet(b.markKey(prefix), clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return nil, translate(ctx, outcome.List, prefix, err)
	}
	// Readers by key (their slots' holders), and waiting writers' marks.
	readers := make(map[string][]*mvccpb.KeyValue)
	for _, kv := range resp.Responses[1].GetResponseRange().GetKvs() {
		if k, _, ok := sqllock.ParseSharedKey(strings.TrimPrefix(string(kv.Key), b.holderKey(""))); ok {
			readers[k] = append(readers[k], kv)
		}
	}
	marks := make(map[string]string)
	for _, kv := range resp.Responses[4].GetResponseRange().GetKvs() {
		marks[strings.TrimPrefix(string(kv.Key), b.markKey(""))] = string(kv.Value)
	}
	holders := make(map[string]*mvccpb.KeyValue)
	for _, kv := range resp.Responses[1].GetResponseRange().GetKvs() {
		holders[strings.TrimPrefix(string(kv.Key), b.holderKey(""))] = kv
	}
	releases := make(map[string]releaseRecord)
	for _, kv := range resp.Responses[2].GetResponseRange().GetKvs() {
		var r releaseRecord
		if err := json.Unmarshal(kv.Value, &r); err != nil {
			return nil, fmt.Errorf("sqllock/etcd: corrupt release record %q: %w", kv.Key, err)
		}
		releases[strings.TrimPrefix(string(kv.Key), b.releaseKey(""))] = r
	}
	holds := make(map[string]*mvccpb.KeyValue)
	for _, kv := range resp.Responses[3].GetResponseRange().GetKvs() {
		holds[strings.TrimPrefix(string(kv.Key), b.holdKey(""))] = kv
	}
	var out []sqllock.LockInfo
	for _, kv := range resp.Responses[0].GetResponseRange().GetKvs() {
		key := strings.TrimPrefix(string(kv.Key), b.tokenKey(""))
		var s keyState
		if err := json.Unmarshal(kv.Value, &s.rec); err != nil {
			return nil, fmt.Errorf("sqllock/etcd: corrupt token record %q: %w", kv.Key, err)
		}
		s.recRev = kv.ModRevision
		s.holder, s.hold = holders[key], holds[key]
		if r, ok := releases[key]; ok {
			s.rel, s.relRev = r, 1
		}
		ks := s.sqllock()
		info := sqllock.LockInfo{Key: key, Token: ks.Token, Owner: ks.Owner, Value: cloneValue(s.rec.Value)}
		if s.taken() {
			// Held, or in its min hold: by the grant's owner, until the
			// later of the two etcd leases' ends.
			info.Held, info.Owner = true, s.rec.Owner
			r := b.recall(key)
			if r.token != s.rec.Token {
				r = seenRecord{}
			}
			var until time.Time
			if s.held() {
				until = b.leaseEnd(ctx, s.holder, r.lease, r.deadline)
			}
			if s.hold != nil {
				until = later(until, b.leaseEnd(ctx, s.hold, r.holdLease, r.holdUntil))
			}
			info.Deadline = until
			info.Remaining = max(time.Until(until), time.Millisecond)
		} else if rs := readers[key]; len(rs) > 0 {
			// Held shared: by no one in particular, until its last
			// reader's end.
			info.Held, info.Owner, info.Shared = true, "", len(rs)
			var until time.Time
			for _, h := range rs {
				slot := strings.TrimPrefix(string(h.Key), b.holderKey(""))
				r := b.recall(slot)
				if tokenString(r.token) != string(h.Value) {
					r = seenRecord{}
				}
				until = later(until, b.leaseEnd(ctx, h, r.lease, r.deadline))
			}
			info.Deadline = until
			info.Remaining = max(time.Until(until), time.Millisecond)
		}
		info.WaitingWriter = marks[key]
		out = append(out, info)
	}
	// etcd returns keys in byte order, which is the order of the suffixes
	// too; sort all the same, as the contract says key order.
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out, nil
}
