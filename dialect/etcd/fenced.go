package etcd

import (
	"context"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// Fenced applies ops in one etcd transaction that commits only while lease
// l holds its key by etcd's own state (the holder key exists with l's
// token, so the etcd lease has not expired and no release or newer grant
// came): for a resource kept in the same etcd, this is a stronger fence
// than comparing tokens, the counterpart of the PostgreSQL backend's
// FencedTx. It costs one round trip.
//
// ops are any etcd operations (puts, deletes, gets, and nested
// transactions made with [clientv3.OpTxn] for compares of the caller's
// own); they must not touch the Backend's own keys. The response's
// Responses are theirs, in order. If l no longer holds the key nothing is
// applied and Fenced returns a [*sqllock.LostError] (matching
// [sqllock.ErrLeaseLost]) with the reason. A transaction whose reply is
// lost returns an error matching [sqllock.ErrIndeterminate]: ops may have
// been applied. The etcd client itself sends a call again after a
// DeadlineExceeded error while ctx is live; the lease compare stays true
// across such a repeat, so make ops idempotent or guard them with compares
// of your own (a revision, as a counter does), as the backend's own
// transactions are.
func (b *Backend) Fenced(ctx context.Context, l sqllock.Lease, ops ...clientv3.Op) (*clientv3.TxnResponse, error) {
	if err := sqllock.ValidateLease(l); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, notSent(outcome.Commit, l.Key, err)
	}
	resp, err := b.cli.Txn(ctx).If(b.holds(l)).Then(ops...).Else(b.readOps(l.Key)...).Commit()
	if err != nil {
		return nil, translate(ctx, outcome.Commit, l.Key, err)
	}
	if !resp.Succeeded {
		return nil, b.loss(l, resp.Responses)
	}
	return resp, nil
}

// holds is the compare that l holds its key: its holder key exists (so its
// etcd lease is alive and nobody released it) with l's token.
func (b *Backend) holds(l sqllock.Lease) clientv3.Cmp {
	return clientv3.Compare(clientv3.Value(b.holderKey(l.Key)), "=", tokenString(l.Token))
}
