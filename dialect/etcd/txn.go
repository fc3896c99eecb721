package etcd

import (
	"context"
	"fmt"
	"math"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// exhausted answers an acquire of a key whose token reached the largest
// int64: refused if held by another, the same grant for its own repeat,
// else ErrTokenExhausted.
func (b *Backend) exhausted(ctx context.Context, lease sqllock.Lease, sp spare) (sqllock.Lease, error) {
	s, err := b.read(ctx, outcome.Acquire, lease.Key)
	if err == nil && s.held() && s.rec.Owner == lease.Owner {
		return b.regrant(ctx, lease, s, sp)
	}
	b.putSpare(sp)
	switch {
	case err != nil:
		return sqllock.Lease{}, err
	case s.taken():
		return sqllock.Lease{}, b.refusal(ctx, lease.Key, s)
	case s.rec.Token < math.MaxInt64:
		return sqllock.Lease{}, fmt.Errorf("sqllock/etcd: acquire %q: %w: the token record changed; try again", lease.Key, sqllock.ErrUnavailable)
	}
	return sqllock.Lease{}, sqllock.ErrTokenExhausted
}

// regrant answers the repeat of an acquire whose grant is held (its reply
// was lost): the same token, the holder moved onto the lease just granted,
// so that its expiry counts from this request.
func (b *Backend) regrant(ctx context.Context, lease sqllock.Lease, s keyState, sp spare) (sqllock.Lease, error) {
	token := tokenString(s.rec.Token)
	resp, err := b.cli.Txn(ctx).If(
		clientv3.Compare(clientv3.Value(b.holderKey(lease.Key)), "=", token),
		clientv3.Compare(clientv3.ModRevision(b.tokenKey(lease.Key)), "=", s.recRev),
	).Then(
		b.withPresence([]clientv3.Op{clientv3.OpPut(b.holderKey(lease.Key), token, clientv3.WithLease(sp.id))}, lease.Key, s.rec.Token, sp.id)...,
	).Else(b.stateOps(lease.Key)...).Commit()
	if err != nil {
		return sqllock.Lease{}, translate(ctx, outcome.Acquire, lease.Key, err)
	}
	if !resp.Succeeded {
		// The grant ended between the two transactions: this acquire's
		// outcome is settled as not granted; a new attempt decides anew.
		b.putSpare(sp)
		s, err := parseState(lease.Key, resp.Responses)
		if err != nil {
			return sqllock.Lease{}, err
		}
		if s.taken() {
			return sqllock.Lease{}, b.refusal(ctx, lease.Key, s)
		}
		return sqllock.Lease{}, fmt.Errorf("sqllock/etcd: acquire %q: %w: the earlier grant of this acquire ended while it was repeated; try again", lease.Key, sqllock.ErrUnavailable)
	}
	b.rememberLease(lease.Key, s.rec.Token, sp.id, lease.Deadline)
	lease.Token, lease.Value = s.rec.Token, cloneValue(s.rec.Value)
	return b.withHold(lease), nil
}

// check reads, in one linearizable read-only transaction, whether l's
// holder key carries its token on etcd lease id; if not, the key's state.
func (b *Backend) check(ctx context.Context, l sqllock.Lease, id clientv3.LeaseID) (keyState, bool, error) {
	resp, err := b.cli.Txn(ctx).If(
		b.holds(l),
		clientv3.Compare(clientv3.LeaseValue(b.holderKey(l.Key)), "=", id),
	).Else(b.readOps(l.Key)...).Commit()
	if err != nil {
		return keyState{}, false, translate(ctx, outcome.Renew, l.Key, err)
	}
	if resp.Succeeded {
		return keyState{}, true, nil
	}
	s, err := parseState(l.Key, resp.Responses)
	if err != nil {
		return keyState{}, false, err
	}
	b.remember(l.Key, s.seen())
	return s, false, nil
}

// renewLonger renews l, whose holder was on etcd lease id, with a TTL of
// want seconds, longer than id was granted with: a new etcd lease, moved
// under the holder in a transaction that compares l's token and id.
func (b *Backend) renewLonger(ctx context.Context, l sqllock.Lease, id clientv3.LeaseID, want int64) (sqllock.Lease, error) {
	sent := time.Now()
	grant, err := b.cli.Grant(ctx, want)
	if err != nil {
		return sqllock.Lease{}, translate(ctx, outcome.Grant, l.Key, err)
	}
	resp, err := b.cli.Txn(ctx).If(
		b.holds(l),
		clientv3.Compare(clientv3.LeaseValue(b.holderKey(l.Key)), "=", id),
	).Then(
		b.withPresence([]clientv3.Op{clientv3.OpPut(b.holderKey(l.Key), tokenString(l.Token), clientv3.WithLease(grant.ID))}, l.Key, l.Token, grant.ID)...,
	).Else(b.readOps(l.Key)...).Commit()
	if err != nil {
		// A renew keeps the token: repeating it is safe, so its unknown
		// outcome is merely unavailable.
		return sqllock.Lease{}, translate(ctx, outcome.Renew, l.Key, err)
	}
	if !resp.Succeeded {
		b.revoke(ctx, grant.ID)
		if lost := b.loss(l, resp.Responses); lost != nil {
			return sqllock.Lease{}, lost
		}
		return sqllock.Lease{}, fmt.Errorf("sqllock/etcd: renew %q: %w: the lease changed during the renewal; try again", l.Key, sqllock.ErrUnavailable)
	}
	b.revoke(ctx, id) // the old etcd lease has no key left
	l.BackendTime, l.Deadline = sent, sent.Add(time.Duration(grant.TTL)*time.Second)
	b.rememberLease(l.Key, l.Token, grant.ID, l.Deadline)
	return b.withHold(l), nil
}

// loss is why l is not valid in the state that an Else branch read.
func (b *Backend) loss(l sqllock.Lease, rs []*etcdserverpb.ResponseOp) error {
	s, err := parseState(l.Key, rs)
	if err != nil {
		return err
	}
	b.remember(l.Key, s.seen())
	if lost := s.sqllock().Loss(l); lost != nil {
		return lost
	}
	// The compare failed, yet the state shows l held: only possible when
	// the holder's value is not the record's token, which no grant writes.
	return fmt.Errorf("sqllock/etcd: %q: holder %q does not match token record %d", l.Key, s.holder.Value, s.rec.Token)
}

// endHold is the operation of a release of l that ends the min hold of
// l's grant unless l's owner releases: a nested transaction that deletes
// the min-hold key unless it names l's token and owner.
func (b *Backend) endHold(l sqllock.Lease) clientv3.Op {
	return clientv3.OpTxn(
		[]clientv3.Cmp{clientv3.Compare(clientv3.Value(b.holdKey(l.Key)), "=", holdValue(l.Token, l.Owner))},
		nil,
		[]clientv3.Op{clientv3.OpDelete(b.holdKey(l.Key))})
}
