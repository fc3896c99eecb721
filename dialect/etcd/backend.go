package etcd

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// Backend is a [sqllock.Backend] and [sqllock.Watcher] on etcd. It is safe
// for concurrent use. Create it with [New].
type Backend struct {
	cli    *clientv3.Client
	prefix string
	maxOps int // operations per transaction, at most

	mu      sync.Mutex            // guards seen, floor, sems, spares, granted, warming
	seen    map[string]seenRecord // the last token record seen per key; a hint only
	floor   floorHint             // the token floor last seen (see reap.go); a hint only
	sems    semCache              // semaphores' limits and owners seen; hints only
	spares  map[int64][]spare     // keyless etcd leases for reuse, by granted TTL (seconds)
	granted map[int64]int64       // requested TTL → the TTL etcd granted for it (seconds)
	warming map[int64]bool        // requested TTLs whose spares are being granted (see warm)
	warmTo  int                   // spares kept at hand per TTL in use; 0: none granted ahead
	warmWG  sync.WaitGroup        // the warm goroutines
	watch   watches
	ka      keepAlives
	acq     *txnGroup // group commit of grants
	rel     *txnGroup // group commit of releases
	sets    *txnGroup // group commit of sets (multi.go)
	permits *txnGroup // group commit of permit acquires (permit.go)
	// permitsInFlight counts the permit acquires in flight; a chain takes
	// permitSpare candidates more (see permitChainLen; tests raise it).
	permitsInFlight atomic.Int64
	permitSpare     int
	// beforeGrant, when set (by tests), is called just before a single
	// acquire's grant transaction is sent, exclusive or shared.
	beforeGrant func(key string)
}

var (
	_ sqllock.Backend       = (*Backend)(nil)
	_ sqllock.Watcher       = (*Backend)(nil)
	_ sqllock.MultiAcquirer = (*Backend)(nil)
)

// New returns a Backend that keeps its keys under opts.Prefix in the etcd
// cluster that cli talks to. It never closes cli. It does no I/O.
func New(cli *clientv3.Client, opts Options) (*Backend, error) {
	if cli == nil {
		return nil, errors.New("sqllock/etcd: nil client")
	}
	prefix := cmp.Or(opts.Prefix, DefaultPrefix)
	if len(prefix) > 256 || !utf8.ValidString(prefix) || strings.IndexByte(prefix, 0) >= 0 {
		return nil, fmt.Errorf("sqllock/etcd: invalid prefix %q: want valid UTF-8 without NUL, at most 256 bytes", prefix)
	}
	if opts.MaxTxnOps != 0 && opts.MaxTxnOps < minTxnOps {
		return nil, fmt.Errorf("sqllock/etcd: invalid MaxTxnOps %d: want 0 (the default, %d) or at least %d", opts.MaxTxnOps, DefaultMaxTxnOps, minTxnOps)
	}
	b := &Backend{cli: cli, prefix: prefix, maxOps: cmp.Or(opts.MaxTxnOps, DefaultMaxTxnOps), seen: make(map[string]seenRecord),
		spares: make(map[int64][]spare), granted: make(map[int64]int64), warming: make(map[int64]bool), warmTo: warmSpares,
		permitSpare: permitSpare}
	b.acq = b.newGroup(outcome.Acquire, 4) // a first grant's 4 compares
	b.rel = b.newGroup(outcome.Release, 2)
	b.sets = b.newGroup(outcome.Acquire, b.maxOps/2)    // sets at most that wide go in batches
	b.permits = b.newGroup(outcome.Acquire, b.maxOps/2) // see permitBatchDepth
	b.watch.b = b
	b.ka.cli = cli
	return b, nil
}

// Prefix returns the etcd key prefix the backend uses.
func (b *Backend) Prefix() string { return b.prefix }

// maxAttempts bounds a grant's transactions when the token record keeps
// changing under it (grants and releases by others between two attempts).
const maxAttempts = 8

// TryAcquire implements [sqllock.Backend]. A grant costs one transaction
// and the keep-alive of a spare etcd lease, sent together (one round trip
// of latency), or a lease grant and then the transaction when no spare is
// at hand (see the package doc for the other cases).
func (b *Backend) TryAcquire(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	return onOwnLeases(ctx, func(ctx context.Context) (sqllock.Lease, error) { return b.tryAcquire(ctx, req) })
}

// tryAcquire is TryAcquire's one attempt (see [onOwnLeases]).
func (b *Backend) tryAcquire(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	if req.Shared {
		return b.tryAcquireShared(ctx, req)
	}
	if err := req.Validate(); err != nil {
		return sqllock.Lease{}, err
	}
	if err := ctx.Err(); err != nil {
		return sqllock.Lease{}, notSent(outcome.Acquire, req.Key, err)
	}
	seen := b.recall(req.Key)
	if seen.held && !req.Mark {
		// A waiter polls a key it saw held: read first, so that a refused
		// attempt writes nothing (no lease grant, no transaction).
		s, err := b.read(ctx, outcome.Acquire, req.Key)
		if err != nil {
			return sqllock.Lease{}, err
		}
		if s.taken() && !(s.held() && s.rec.Owner == req.Owner) {
			return sqllock.Lease{}, b.refusal(ctx, req.Key, s)
		}
		seen = s.seen()
	}
	grant, hold, err := b.takeLeases(ctx, req)
	if err != nil {
		return sqllock.Lease{}, err
	}
	// The spares' keep-alives go out with the first transaction, not
	// before it: one round trip of latency for both.
	renewed := b.renewSpares(ctx, &grant, &hold)
	waited, gone := false, false
	settle := func() (sqllock.Lease, bool) {
		if !waited {
			waited, gone = true, renewed()
		}
		start := grant.at
		if hold.id != 0 && hold.at.Before(start) {
			start = hold.at
		}
		return sqllock.Lease{Key: req.Key, Owner: req.Owner, BackendTime: start, Deadline: start.Add(time.Duration(max(grant.ttl, hold.ttl)) * time.Second)}, gone
	}
	for range maxAttempts {
		// A first grant (no token record) starts above the floor, and
		// compares it unchanged (see reap.go).
		first := seen.rev == 0
		var floor floorHint
		if first {
			floor = b.floorSeen()
			seen.token = max(seen.token, floor.value)
		}
		if seen.token == math.MaxInt64 {
			lease, gone := settle()
			b.putSpare(hold)
			if gone {
				b.putSpare(grant)
				return sqllock.Lease{}, b.leaseGone(req.Key)
			}
			if first {
				b.putSpare(grant)
				return sqllock.Lease{}, fmt.Errorf("%w: key %q: the token floor of reaped keys is at the end", sqllock.ErrTokenExhausted, req.Key)
			}
			return b.exhausted(ctx, lease, grant)
		}
		token := seen.token + 1
		rec, err := json.Marshal(tokenRecord{Token: token, Owner: req.Owner, Value: req.Value})
		if err != nil {
			return sqllock.Lease{}, err
		}
		if err := ctx.Err(); err != nil {
			return sqllock.Lease{}, notSent(outcome.Acquire, req.Key, err)
		}
		puts := []clientv3.Op{
			clientv3.OpPut(b.tokenKey(req.Key), string(rec)),
			clientv3.OpPut(b.holderKey(req.Key), tokenString(token), clientv3.WithLease(grant.id)),
		}
		if hold.id != 0 {
			puts = append(puts, clientv3.OpPut(b.holdKey(req.Key), holdValue(token, req.Owner), clientv3.WithLease(hold.id)))
		}
		if req.Mark {
			puts = append(puts, b.unmarkOp(req.Key, req.Owner)) // a waiting writer's grant ends its mark
		}
		cmps := []clientv3.Cmp{
			clientv3.Compare(clientv3.CreateRevision(b.holderKey(req.Key)), "=", 0),
			b.noHold(req.Key, seen.shared), // no min hold, no reader (see shared.go)
			clientv3.Compare(clientv3.ModRevision(b.tokenKey(req.Key)), "=", seen.rev),
		}
		reads := b.stateOps(req.Key)
		if first {
			cmps = append(cmps, b.firstGrantCmp(floor))
			reads = append(reads, clientv3.OpGet(b.floorKey()))
		}
		reads = append(reads, b.readerOps(req.Key)...)
		if req.Mark {
			reads = append(reads, b.markOps(req.Key, req.Owner, grant.id))
		}
		if b.beforeGrant != nil {
			b.beforeGrant(req.Key)
		}
		grantTxn := func() (*clientv3.TxnResponse, error) {
			return b.cli.Txn(ctx).If(cmps...).Then(puts...).Else(reads...).Commit()
		}
		var resp *clientv3.TxnResponse
		if hold.id == 0 && !req.Mark {
			// Without a min hold, a grant may share a transaction with
			// others (see txnGroup).
			var o groupOutcome
			resp, o, err = b.viaGroup(ctx, b.acq, req.Key, clientv3.OpTxn(cmps, puts, nil), 4*len(b.tokenKey(req.Key))+len(rec)+64, grantTxn)
			switch {
			case o.err != nil:
				return sqllock.Lease{}, o.err
			case o.tr != nil:
				resp = &clientv3.TxnResponse{Header: &etcdserverpb.ResponseHeader{Revision: o.rev}, Succeeded: true}
			}
		} else {
			resp, err = grantTxn()
		}
		if err != nil {
			// Neither etcd lease is kept as a spare: a key may be on it.
			return sqllock.Lease{}, translate(ctx, outcome.Acquire, req.Key, err)
		}
		lease, gone := settle()
		if resp.Succeeded {
			var until time.Time
			if hold.id != 0 {
				until = hold.at.Add(time.Duration(hold.ttl) * time.Second)
			}
			b.remember(req.Key, seenRecord{rev: resp.Header.Revision, token: token, lease: grant.id,
				deadline: grant.at.Add(time.Duration(grant.ttl) * time.Second), holdLease: hold.id, holdUntil: until})
			if gone {
				// Granted on an etcd lease that etcd no longer knows:
				// the grant is over already, and nobody holds the key.
				return sqllock.Lease{}, b.leaseGone(req.Key)
			}
			lease.Token, lease.Value = token, cloneValue(req.Value)
			return lease, nil
		}
		rs := resp.Responses
		marked := false
		if req.Mark {
			marked = markSet(rs[len(rs)-1])
			rs = rs[:len(rs)-1]
		}
		readers := rs[len(rs)-2:]
		rs = rs[:len(rs)-2]
		if first {
			if _, err := b.noteFloor(rs[len(rs)-1].GetResponseRange().GetKvs()); err != nil {
				return sqllock.Lease{}, err
			}
			rs = rs[:len(rs)-1]
		}
		s, err := parseState(req.Key, rs)
		if err != nil {
			return sqllock.Lease{}, err
		}
		b.remember(req.Key, s.seen())
		if s.taken() {
			b.putSpare(hold) // a repeat keeps its first grant's hold
			if s.held() && s.rec.Owner == req.Owner {
				if grant.id == 0 {
					return sqllock.Lease{}, b.leaseGone(req.Key)
				}
				lease.BackendTime = grant.at
				lease.Deadline = grant.at.Add(time.Duration(grant.ttl) * time.Second)
				return b.regrant(ctx, lease, s, grant)
			}
			if !marked {
				b.putSpare(grant) // none when gone
			}
			he := b.refusal(ctx, req.Key, s)
			if h, ok := he.(*sqllock.HeldError); ok {
				h.WaitingWriter = markOwner(markOf(readers))
			}
			return sqllock.Lease{}, he
		}
		if he := b.readersRefusal(ctx, req.Key, s, readers); he != nil {
			b.putSpare(hold)
			if !marked {
				b.putSpare(grant)
			}
			return sqllock.Lease{}, he
		}
		// Free, but the token record changed since this Backend saw it:
		// try again on the record just read.
		seen = s.seen()
	}
	settle()
	b.putSpare(grant) // none when gone
	b.putSpare(hold)
	return sqllock.Lease{}, fmt.Errorf("sqllock/etcd: acquire %q: %w: the key changed under %d attempts in a row", req.Key, sqllock.ErrUnavailable, maxAttempts)
}

// leaseGone is the error of an acquire whose transaction put the holder
// key on a spare etcd lease whose renewal by the keep-alive sent with it
// is not known (see [Backend.renewSpares]): not granted (no lease dated
// from before the acquire was sent, no holder key that etcd may have
// deleted), and a new attempt decides anew: the same owner's repeat gets
// the grant onto a new etcd lease if it still holds. The acquire's entry
// point makes that attempt itself (see [onOwnLeases]).
func (b *Backend) leaseGone(key string) error {
	return &spareGoneError{fmt.Sprintf("sqllock/etcd: acquire %q: %v: the keep-alive of the grant's etcd lease did not confirm it; try again", key, sqllock.ErrUnavailable)}
}

// spareGoneError is the error of an acquire that put its holder keys on
// spare etcd leases whose renewal is not known (see [Backend.leaseGone]):
// [sqllock.ErrUnavailable], which [onOwnLeases] answers by one more
// attempt.
type spareGoneError struct{ msg string }

func (e *spareGoneError) Error() string { return e.msg }
func (e *spareGoneError) Unwrap() error { return sqllock.ErrUnavailable }

// ownLeasesKey marks a context whose acquire takes no spare etcd lease:
// it grants the leases it puts keys on (see [Backend.etcdLease]).
type ownLeasesKey struct{}

// onOwnLeases runs the attempt acquire and, when it put its keys on spare
// etcd leases whose renewal is not known (a spare that expired in the pool
// while etcd was slow to answer its keep-alive, or a keep-alive stream
// that broke), runs it once more on etcd leases granted for it. That
// attempt is the same owner's repeat: a key the first one left held by
// the owner is granted again with its token, moved onto the new etcd
// lease; one etcd let go is granted with the next token. A lease granted
// for the attempt needs no keep-alive (its period began after the attempt
// was sent), so the second attempt cannot end the same way, and a caller
// never sees this Backend's use of spares fail an acquire etcd could
// grant.
func onOwnLeases[T any](ctx context.Context, acquire func(context.Context) (T, error)) (T, error) {
	v, err := acquire(ctx)
	if _, gone := errors.AsType[*spareGoneError](err); !gone || ctx.Err() != nil {
		return v, err
	}
	return acquire(context.WithValue(ctx, ownLeasesKey{}, true))
}

// TryRenew implements [sqllock.Backend]: a keep-alive restarts the TTL of
// the etcd lease that the holder key was last seen on, and then a
// linearizable read-only transaction checks that the holder key still
// carries l's token on that etcd lease; only both together are a renewal,
// dated from the keep-alive's send time. The check comes after the
// keep-alive, not before, because some etcd servers answer a keep-alive
// racing the revocation of an expired lease with a positive TTL after the
// lease's keys were deleted (etcd-io/etcd#20547; see the package doc): a
// check before it would not see the key go. When this Backend has not
// seen the holder's etcd lease (l was granted elsewhere), a read finds it
// first. A TTL longer than the etcd lease was granted with gets a new etcd
// lease instead, moved under the holder in a transaction that compares the
// token and the old etcd lease.
func (b *Backend) TryRenew(ctx context.Context, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
	if err := sqllock.ValidateLease(l); err != nil {
		return sqllock.Lease{}, err
	}
	if err := sqllock.ValidateTTL(ttl); err != nil {
		return sqllock.Lease{}, err
	}
	if err := ctx.Err(); err != nil {
		return sqllock.Lease{}, notSent(outcome.Renew, l.Key, err)
	}
	want := ttlSeconds(ttl)
	id := b.leaseHint(l)
	for range maxAttempts {
		if id == 0 {
			// Which etcd lease the holder is on: this read is not the
			// check, which follows the keep-alive.
			s, err := b.read(ctx, outcome.Renew, l.Key)
			if err != nil {
				return sqllock.Lease{}, err
			}
			if lost := s.sqllock().Loss(l); lost != nil {
				return sqllock.Lease{}, lost
			}
			id = clientv3.LeaseID(s.holder.Lease)
		}
		sent := time.Now()
		granted, err := b.ka.once(ctx, id)
		alive := err == nil
		if err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
			return sqllock.Lease{}, translate(ctx, outcome.Renew, l.Key, err)
		}
		if alive && granted < want {
			return b.renewLonger(ctx, l, id, want)
		}
		s, ok, err := b.check(ctx, l, id)
		if err != nil {
			return sqllock.Lease{}, err
		}
		switch {
		case ok && alive:
			l.BackendTime, l.Deadline = sent, sent.Add(time.Duration(granted)*time.Second)
			b.rememberLease(l.Key, l.Token, id, l.Deadline)
			return b.withHold(l), nil
		case ok:
			// etcd no longer knows the lease, and its keys go with it.
			return sqllock.Lease{}, &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostExpired}
		}
		if lost := s.sqllock().Loss(l); lost != nil {
			return sqllock.Lease{}, lost
		}
		// l holds its key, on another etcd lease than the one kept alive
		// (moved there by a repeated acquire or a longer renewal): keep
		// that one alive, and check again.
		id = clientv3.LeaseID(s.holder.Lease)
		b.rememberLease(l.Key, l.Token, id, time.Time{})
	}
	return sqllock.Lease{}, fmt.Errorf("sqllock/etcd: renew %q: %w: the holder moved between etcd leases under %d attempts in a row", l.Key, sqllock.ErrUnavailable, maxAttempts)
}
