package etcd

import (
	"cmp"
	"context"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// spare is an etcd lease with no key attached: one that this Backend
// granted ahead of need (see [Backend.warm]) or for an acquire that was
// refused, or whose holder key a release deleted. An acquire with the same
// TTL takes it, with a keep-alive sent together with its transaction,
// instead of a lease grant (a raft write) before it.
type spare struct {
	id  clientv3.LeaseID
	ttl int64     // seconds, as granted
	at  time.Time // no later than when its current TTL period began
	// fresh: granted by this Backend at at, with no keep-alive since;
	// not taken until freshFor has passed.
	fresh bool
	// taken: from the spares, for an acquire sent after its period began,
	// which needs its keep-alive (see [Backend.renewSpares]); false for
	// a lease granted for the acquire, whose period began after it.
	taken bool
}

// maxSpares bounds the spares kept per TTL; past it a spare is left to
// expire.
const maxSpares = 256

// warmSpares is how many spares of a TTL in use this Backend keeps at
// hand: an acquire that leaves fewer starts a background grant of more
// (see [Backend.warm]), so that no lease grant sits on an acquire's path
// while releases and refusals keep returning leases.
const warmSpares = 16

// freshFor is how long after its grant was sent a fresh spare is left
// untaken: a keep-alive sent just after a grant may be answered with TTL
// 0 by an etcd 3.4 leader that has not applied the grant yet
// (etcd-io/etcd#13675, not backported to 3.4). A spare is never used
// without a keep-alive: its TTL period began before the acquire was sent,
// and the Client dates its local deadline from the acquire's send time.
const freshFor = time.Second

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

// takeLeases returns the etcd lease for req's grant and, when req has a
// MinHold, the one its min-hold key goes on (else a zero spare): spares
// when at hand, else new grants sent together (a min hold costs a second
// lease grant but no round trip more). A spare may still need its
// keep-alive (see [Backend.renewSpares]).
func (b *Backend) takeLeases(ctx context.Context, req sqllock.AcquireRequest) (grant, hold spare, err error) {
	if req.MinHold == 0 {
		grant, err = b.etcdLease(ctx, req.Key, ttlSeconds(req.TTL))
		return grant, spare{}, err
	}
	var holdErr error
	done := make(chan struct{})
	go func() {
		defer close(done)
		hold, holdErr = b.etcdLease(ctx, req.Key, ttlSeconds(req.MinHold))
	}()
	grant, err = b.etcdLease(ctx, req.Key, ttlSeconds(req.TTL))
	<-done
	if err != nil || holdErr != nil {
		// Neither has a key yet: kept for reuse.
		b.putSpare(grant)
		b.putSpare(hold)
		return spare{}, spare{}, cmp.Or(err, holdErr)
	}
	return grant, hold, nil
}

// etcdLease returns an etcd lease for a grant of sec seconds: a spare of
// the TTL etcd grants for sec when one is at hand and ctx allows it (see
// [onOwnLeases]), else a new grant (whose TTL period begins after it was
// sent). It tops up the spares of that TTL in the background when they
// run low.
func (b *Backend) etcdLease(ctx context.Context, key string, sec int64) (spare, error) {
	defer b.warmIfLow(sec)
	if ctx.Value(ownLeasesKey{}) == nil {
		if sp, ok := b.takeSpare(sec); ok {
			return sp, nil
		}
	}
	sp, err := b.grant(ctx, sec)
	if err != nil {
		// An unused lease changes nothing and expires by itself.
		return spare{}, translate(ctx, outcome.Grant, key, err)
	}
	return sp, nil
}

// grant grants a new etcd lease of sec seconds: a fresh spare.
func (b *Backend) grant(ctx context.Context, sec int64) (spare, error) {
	sent := time.Now()
	resp, err := b.cli.Grant(ctx, sec)
	if err != nil {
		return spare{}, err
	}
	b.mu.Lock()
	b.granted[sec] = resp.TTL
	b.mu.Unlock()
	return spare{id: resp.ID, ttl: resp.TTL, at: sent, fresh: true}, nil
}

// renewSpares sends one keep-alive for each of the spares taken (see
// [spare.taken]; a zero one is none) on the Backend's stream, without waiting for the replies: the
// caller sends its transaction meanwhile, and then calls the function
// returned, which waits for the replies and updates the spares. A spare
// renewed starts its TTL period after the keep-alive's send time, taken
// before it was sent, so after the acquire was. A spare is gone (its id
// zeroed; the function reports it) when its renewal is not known: etcd no
// longer knows it; the keep-alive failed (the spare's period began before
// the acquire was sent, which the Client's local deadline does not allow
// for); or its reply came too late to tell: the transaction may have put a
// key on it before it expired, and a keep-alive that reached etcd after
// the expiry may be answered with a positive TTL once the lease's keys are
// deleted (etcd-io/etcd#20547). A reply that came before the spare's TTL
// period could have ended was answered on a live lease, so the key the
// transaction put on it (before or after) stays.
func (b *Backend) renewSpares(ctx context.Context, sps ...*spare) func() (gone bool) {
	var ids []clientv3.LeaseID
	var renew []*spare
	for _, sp := range sps {
		if sp.id != 0 && sp.taken {
			ids, renew = append(ids, sp.id), append(renew, sp)
		}
	}
	if len(ids) == 0 {
		return func() bool { return false }
	}
	type result struct {
		ttls []int64
		got  time.Time
		err  error
	}
	sent := time.Now()
	done := make(chan result, 1)
	go func() {
		ttls, err := b.ka.many(ctx, ids)
		done <- result{ttls, time.Now(), err}
	}()
	return func() (gone bool) {
		r := <-done
		if r.err != nil {
			for _, sp := range renew {
				sp.id = 0 // renewed or not: not known
			}
			return true
		}
		for i, sp := range renew {
			if r.ttls[i] <= 0 || !r.got.Before(sp.at.Add(time.Duration(sp.ttl)*time.Second)) {
				sp.id, gone = 0, true
				continue
			}
			sp.ttl, sp.at, sp.fresh, sp.taken = r.ttls[i], sent, false, false
		}
		return gone
	}
}

// warmIfLow starts a background grant of spares of the TTL etcd grants
// for sec seconds when fewer than warmSpares of them are likely alive, and
// none is under way. The grants go on the client's context, bounded.
func (b *Backend) warmIfLow(sec int64) {
	b.mu.Lock()
	defer b.mu.Unlock()
	ttl, ok := b.granted[sec]
	if !ok || b.warming[sec] {
		return
	}
	b.pruneSpares(ttl)
	n := b.warmTo - len(b.spares[ttl])
	if n <= 0 {
		return
	}
	b.warming[sec] = true
	b.warmWG.Add(1)
	go b.warm(sec, n)
}

// warm grants n etcd leases of sec seconds, sent together, and keeps them
// as spares: leases granted ahead of the acquires that take them. Best
// effort: a lease it cannot grant is one an acquire grants itself.
func (b *Backend) warm(sec int64, n int) {
	defer b.warmWG.Done()
	defer func() {
		b.mu.Lock()
		delete(b.warming, sec)
		b.mu.Unlock()
	}()
	ctx, cancel := context.WithTimeout(b.cli.Ctx(), 5*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for range n {
		wg.Go(func() {
			if sp, err := b.grant(ctx, sec); err == nil {
				b.putSpare(sp)
			}
		})
	}
	wg.Wait()
}

// takeSpare takes a spare of the TTL etcd grants for sec seconds that has
// most likely not expired yet (a second of its TTL left, by this host's
// clock), the last one kept first, leaving fresh spares younger than
// freshFor.
func (b *Backend) takeSpare(sec int64) (spare, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	ttl, ok := b.granted[sec]
	if !ok {
		return spare{}, false
	}
	list := b.spares[ttl]
	for i := len(list) - 1; i >= 0; i-- {
		sp := list[i]
		if sp.fresh && time.Since(sp.at) < freshFor {
			continue // left for later
		}
		list = append(list[:i], list[i+1:]...)
		if sp.alive() {
			b.spares[ttl] = list
			sp.taken = true
			return sp, true
		}
	}
	b.spares[ttl] = list
	return spare{}, false
}

// alive reports whether sp has most likely not expired yet: a second of
// its TTL left, by this host's clock.
func (sp spare) alive() bool {
	return time.Since(sp.at) < time.Duration(sp.ttl-1)*time.Second
}

// pruneSpares drops the spares of TTL ttl that alive no longer reports.
// b.mu is held.
func (b *Backend) pruneSpares(ttl int64) {
	list := b.spares[ttl][:0]
	for _, sp := range b.spares[ttl] {
		if sp.alive() {
			list = append(list, sp)
		}
	}
	b.spares[ttl] = list
}

// putSpare keeps sp, which has no key, for reuse (none when sp.id is 0).
func (b *Backend) putSpare(sp spare) {
	if sp.id == 0 {
		return
	}
	sp.taken = false
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
