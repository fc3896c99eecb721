package etcd

import (
	"cmp"
	"context"
	"errors"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// spare is an etcd lease with no key attached: one that this Backend
// granted for an acquire that was refused, or whose holder key a release
// deleted. An acquire with the same TTL reuses it with a keep-alive (served
// by the etcd leader alone) instead of a lease grant (a raft write).
type spare struct {
	id  clientv3.LeaseID
	ttl int64     // seconds, as granted
	at  time.Time // no later than when its current TTL period began
}

// maxSpares bounds the spares kept per TTL; past it a spare is left to
// expire.
const maxSpares = 256

// withHold is l with its Deadline at least the end of its grant's min
// hold, when this Backend made that grant: a renewal never reports a
// deadline before grant + MinHold. The hold is etcd's own (its key's
// lease), so this is the report only, never the decision.
func (b *Backend) withHold(l sqllock.Lease) sqllock.Lease {
	if r := b.recall(l.Key); r.token == l.Token && r.holdUntil.After(l.Deadline) {
		l.Deadline = r.holdUntil
	}
	return l
}

// ttlSeconds rounds ttl up to whole seconds: etcd's lease resolution.
func ttlSeconds(ttl time.Duration) int64 {
	return int64((ttl + time.Second - 1) / time.Second)
}

// grantLeases returns the etcd lease for req's grant and, when req has a
// MinHold, the one its min-hold key goes on (else a zero spare), both
// granted (or renewed from spares) after sent, at the same time: a min
// hold costs a second lease grant but no round trip more.
func (b *Backend) grantLeases(ctx context.Context, req sqllock.AcquireRequest, sent time.Time) (grant, hold spare, err error) {
	if req.MinHold == 0 {
		grant, err = b.etcdLease(ctx, req.Key, ttlSeconds(req.TTL), sent)
		return grant, spare{}, err
	}
	var holdErr error
	done := make(chan struct{})
	go func() {
		defer close(done)
		hold, holdErr = b.etcdLease(ctx, req.Key, ttlSeconds(req.MinHold), sent)
	}()
	grant, err = b.etcdLease(ctx, req.Key, ttlSeconds(req.TTL), sent)
	<-done
	if err != nil || holdErr != nil {
		// Neither has a key yet: kept for reuse.
		b.putSpare(grant)
		b.putSpare(hold)
		return spare{}, spare{}, cmp.Or(err, holdErr)
	}
	return grant, hold, nil
}

// etcdLease returns an etcd lease for a grant of sec seconds, whose TTL
// period begins after sent: a spare renewed with a keep-alive when one of
// the TTL etcd grants for sec is at hand, else a new grant.
func (b *Backend) etcdLease(ctx context.Context, key string, sec int64, sent time.Time) (spare, error) {
	for {
		sp, ok := b.takeSpare(sec)
		if !ok {
			break
		}
		granted, err := b.ka.once(ctx, sp.id)
		if errors.Is(err, rpctypes.ErrLeaseNotFound) {
			continue // expired while unused
		}
		if err != nil {
			return spare{}, translate(ctx, outcome.Grant, key, err)
		}
		if granted != sp.ttl {
			continue // not the lease it was taken for; it expires by itself
		}
		sp.at = sent
		return sp, nil
	}
	grant, err := b.cli.Grant(ctx, sec)
	if err != nil {
		// An unused lease changes nothing and expires by itself.
		return spare{}, translate(ctx, outcome.Grant, key, err)
	}
	b.mu.Lock()
	b.granted[sec] = grant.TTL
	b.mu.Unlock()
	return spare{id: grant.ID, ttl: grant.TTL, at: sent}, nil
}

// takeSpare takes a spare of the TTL etcd grants for sec seconds that has
// most likely not expired yet (a second of its TTL left, by this host's
// clock).
func (b *Backend) takeSpare(sec int64) (spare, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	ttl, ok := b.granted[sec]
	if !ok {
		return spare{}, false
	}
	for list := b.spares[ttl]; len(list) > 0; list = b.spares[ttl] {
		sp := list[len(list)-1]
		b.spares[ttl] = list[:len(list)-1]
		if time.Since(sp.at) < time.Duration(sp.ttl-1)*time.Second {
			return sp, true
		}
	}
	return spare{}, false
}

// putSpare keeps sp, which has no key, for reuse (none when sp.id is 0).
func (b *Backend) putSpare(sp spare) {
	if sp.id == 0 {
		return
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if len(b.spares[sp.ttl]) < maxSpares {
		b.spares[sp.ttl] = append(b.spares[sp.ttl], sp)
	}
}

// refusal is the HeldError for state s, with the holder's remaining time
// from etcd's lease (whole seconds, rounded down; 0 when etcd could not
// tell).
func (b *Backend) refusal(ctx context.Context, key string, s keyState) error {
	he := &sqllock.HeldError{Key: key, Owner: s.rec.Owner, Token: s.rec.Token, Value: cloneValue(s.rec.Value)}
	if s.held() {
		he.Remaining = b.remaining(ctx, clientv3.LeaseID(s.holder.Lease))
	}
	if s.hold != nil {
		// Held until the later of the holder's lease and the min hold's.
		he.Remaining = max(he.Remaining, b.remaining(ctx, clientv3.LeaseID(s.hold.Lease)))
	}
	return he
}

// remaining is the time left on etcd lease id: whole seconds, rounded
// down, and at least a millisecond (a lease with less than a second left
// is still held); 0 when etcd could not tell.
func (b *Backend) remaining(ctx context.Context, id clientv3.LeaseID) time.Duration {
	ttl, err := b.cli.TimeToLive(ctx, id)
	if err != nil || ttl.TTL < 0 {
		return 0
	}
	return max(time.Duration(ttl.TTL)*time.Second, time.Millisecond)
}

// revoke ends an etcd lease this Backend granted and did not use. It is
// best effort and bounded: a lease left behind has no keys and expires by
// itself.
func (b *Backend) revoke(ctx context.Context, id clientv3.LeaseID) {
	rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	_, _ = b.cli.Revoke(rctx, id)
}

// leaseEnd is when the etcd lease of kv ends: known, the Deadline this
// Backend reported for it when kv is on etcd lease id; else from etcd's
// time-to-live (one round trip, whole seconds).
func (b *Backend) leaseEnd(ctx context.Context, kv *mvccpb.KeyValue, id clientv3.LeaseID, known time.Time) time.Time {
	if clientv3.LeaseID(kv.Lease) == id && !known.IsZero() {
		return known
	}
	now := time.Now()
	return now.Add(b.remaining(ctx, clientv3.LeaseID(kv.Lease)))
}

func later(a, b time.Time) time.Time {
	if b.After(a) {
		return b
	}
	return a
}
