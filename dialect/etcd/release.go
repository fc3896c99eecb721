package etcd

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// Release implements [sqllock.Backend]: one transaction (one raft write)
// that deletes the holder and records who released, iff l's token holds
// the key; a second when it finds a min-hold key that this Backend did
// not grant (see releaseTxn). The
// min-hold key of l's grant stays when its owner releases (the key stays
// taken until etcd expires the hold's lease), and goes when another owner
// does (a forced release ends the hold at once).
func (b *Backend) Release(ctx context.Context, l sqllock.Lease) error {
	if err := sqllock.ValidateLease(l); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return notSent(outcome.Release, l.Key, err)
	}
	seen := b.recall(l.Key)
	rel, err := json.Marshal(releaseRec(l, seen))
	if err != nil {
		return err
	}
	// The common release is flat: the holder's delete and the release
	// record, iff l holds the key and no min-hold key is there. When this
	// Backend granted l with a min hold, or the flat one finds a min-hold
	// key that it did not know of, the release ends the hold too unless
	// l's owner releases (a nested transaction, about 50 µs more).
	flat := !(seen.token == l.Token && seen.holdLease != 0)
	var resp *clientv3.TxnResponse
	switch {
	case flat && isSlot(l.Key):
		// A reader's release deletes its presence key too: one operation
		// more than a batch's member has room for (see txnGroup).
		resp, err = b.releaseTxn(ctx, l, string(rel), true)
	case flat:
		var o groupOutcome
		resp, o, err = b.viaGroup(ctx, b.rel, l.Key, b.releaseOp(l, string(rel)), 4*len(b.holderKey(l.Key))+len(rel)+64,
			func() (*clientv3.TxnResponse, error) { return b.releaseTxn(ctx, l, string(rel), true) })
		switch {
		case o.err != nil:
			return o.err
		case o.tr != nil:
			b.released(l, seen, o.tr.Responses[0].GetResponseDeleteRange().GetPrevKvs())
			return nil
		}
	default:
		resp, err = b.releaseTxn(ctx, l, string(rel), false)
	}
	if err == nil && !resp.Succeeded && flat {
		if s, perr := parseState(l.Key, resp.Responses); perr == nil && s.hold != nil && s.held() && s.rec.Token == l.Token {
			resp, err = b.releaseTxn(ctx, l, string(rel), false)
		}
	}
	if err != nil {
		return translate(ctx, outcome.Release, l.Key, err)
	}
	if resp.Succeeded {
		b.released(l, seen, resp.Responses[0].GetResponseDeleteRange().GetPrevKvs())
		return nil
	}
	for range maxAttempts {
		s, err := parseState(l.Key, resp.Responses)
		if err != nil {
			return err
		}
		ks := s.sqllock()
		if ks.ReleasedByOwner(l) {
			return nil // a repeat by the owner that released
		}
		if s.holder == nil && s.recRev != 0 && s.rec.Owner == "" && s.rec.Token == l.Token && !s.released() {
			// K's token record written by a reader's grant: a forced
			// release of K held shared ends its readers.
			return b.releaseReaders(ctx, l, s)
		}
		lost := ks.Loss(l)
		// A forced release of a grant in its min hold, held or released
		// by its owner already: the hold ends now.
		forced := s.hold != nil && s.rec.Token == l.Token && string(s.hold.Value) != holdValue(l.Token, l.Owner)
		if lost == nil || (lost.Reason != sqllock.LostExpired && !forced) {
			return lostOrNil(lost)
		}
		// Expired (or in a min hold), token current: record the release
		// all the same (as every backend clears the row), so that a
		// repeat is nil.
		var holdRev int64
		if s.hold != nil {
			holdRev = s.hold.ModRevision
		}
		resp, err = b.cli.Txn(ctx).If(
			clientv3.Compare(clientv3.ModRevision(b.tokenKey(l.Key)), "=", s.recRev),
			clientv3.Compare(clientv3.CreateRevision(b.holderKey(l.Key)), "=", 0),
			clientv3.Compare(clientv3.ModRevision(b.releaseKey(l.Key)), "=", s.relRev),
			clientv3.Compare(clientv3.ModRevision(b.holdKey(l.Key)), "=", holdRev),
		).Then(
			clientv3.OpPut(b.releaseKey(l.Key), string(rel)),
			b.endHold(l),
		).Else(b.stateOps(l.Key)...).Commit()
		if err != nil {
			return translate(ctx, outcome.Release, l.Key, err)
		}
		if resp.Succeeded {
			return lost
		}
	}
	return fmt.Errorf("sqllock/etcd: release %q: %w: the key changed under %d attempts in a row", l.Key, sqllock.ErrUnavailable, maxAttempts)
}

// released records the release of l, whose holder key's previous value
// was prev, when this Backend last saw seen of its key.
func (b *Backend) released(l sqllock.Lease, seen seenRecord, prev []*mvccpb.KeyValue) {
	b.rememberLease(l.Key, l.Token, 0, time.Time{})
	b.releasedPermit(l)
	// The etcd lease is left without a key: kept for reuse (its TTL
	// period began no earlier than l's BackendTime), else it expires by
	// itself; a revoke would cost a raft write for nothing. Not when l's
	// Deadline may be its min hold's end rather than its etcd lease's: the
	// TTL would be wrong.
	leaseEnd := l.Deadline
	if seen.token == l.Token && !seen.holdUntil.IsZero() && !l.Deadline.After(seen.holdUntil) {
		leaseEnd = time.Time{}
	}
	if len(prev) == 1 && prev[0].Lease != 0 {
		if ttl := leaseEnd.Sub(l.BackendTime); ttl > 0 && ttl%time.Second == 0 && !l.BackendTime.IsZero() {
			b.putSpare(spare{id: clientv3.LeaseID(prev[0].Lease), ttl: int64(ttl / time.Second), at: l.BackendTime})
		}
	}
}

// releaseOp is the flat release of l, record rel, as a nested
// transaction of a batch (see txnGroup): releaseTxn's, without its reads.
func (b *Backend) releaseOp(l sqllock.Lease, rel string) clientv3.Op {
	return clientv3.OpTxn(
		[]clientv3.Cmp{b.holds(l), clientv3.Compare(clientv3.CreateRevision(b.holdKey(l.Key)), "=", 0)},
		b.withoutPresence([]clientv3.Op{
			clientv3.OpDelete(b.holderKey(l.Key), clientv3.WithPrevKV()),
			clientv3.OpPut(b.releaseKey(l.Key), rel),
		}, l.Key), nil)
}

// releaseTxn is the transaction of a release of l that holds the key:
// the holder's delete (its previous value returned) and release record
// rel; flat, iff no min-hold key is there, else with the nested
// transaction that ends the hold unless l's owner releases.
func (b *Backend) releaseTxn(ctx context.Context, l sqllock.Lease, rel string, flat bool) (*clientv3.TxnResponse, error) {
	cmps := []clientv3.Cmp{b.holds(l)}
	ops := b.withoutPresence([]clientv3.Op{
		clientv3.OpDelete(b.holderKey(l.Key), clientv3.WithPrevKV()),
		clientv3.OpPut(b.releaseKey(l.Key), rel),
	}, l.Key)
	if flat {
		cmps = append(cmps, clientv3.Compare(clientv3.CreateRevision(b.holdKey(l.Key)), "=", 0))
	} else {
		ops = append(ops, b.endHold(l))
	}
	return b.cli.Txn(ctx).If(cmps...).Then(ops...).Else(b.stateOps(l.Key)...).Commit()
}

func lostOrNil(lost *sqllock.LostError) error {
	if lost == nil {
		return nil
	}
	return lost
}
