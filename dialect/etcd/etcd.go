package etcd

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
	"unicode/utf8"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/sqllock"
)

// DefaultPrefix is the etcd key prefix under which a Backend keeps its keys
// when [Options.Prefix] is empty.
const DefaultPrefix = "sqllock/"

// Options configures a [Backend]. The zero value means the defaults.
type Options struct {
	// Prefix is prepended to every etcd key the backend reads or writes
	// (default [DefaultPrefix]). Backends with different prefixes share
	// nothing. It must be valid UTF-8 without NUL, at most 256 bytes.
	Prefix string
	// MaxTxnOps is the most operations the Backend puts in one etcd
	// transaction (default [DefaultMaxTxnOps], etcd's own default); set
	// it to the cluster's --max-txn-ops if that is lower; at least 5,
	// which a release needs. A batch renewal of more leases than fit is
	// split into several transactions.
	MaxTxnOps int
}

// Backend is a [sqllock.Backend] and [sqllock.Watcher] on etcd. It is safe
// for concurrent use. Create it with [New].
type Backend struct {
	cli    *clientv3.Client
	prefix string
	maxOps int // operations per transaction, at most

	mu      sync.Mutex            // guards seen, spares, granted
	seen    map[string]seenRecord // the last token record seen per key; a hint only
	spares  map[int64][]spare     // keyless etcd leases for reuse, by granted TTL (seconds)
	granted map[int64]int64       // requested TTL → the TTL etcd granted for it (seconds)
	watch   watches
	ka      keepAlives
}

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

// seenRecord is what this Backend last saw of a key: the token record's
// revision and token (so that a grant's transaction can compare and
// increment without reading first), whether the key was held then (so
// that a waiter's next attempt reads before it grants a lease), and the
// etcd lease its holder is on (so that a renewal sends its keep-alive
// first; the check after it decides).
type seenRecord struct {
	rev   int64 // the token record's mod revision; 0: no record
	token int64
	held  bool
	lease clientv3.LeaseID // the etcd lease of the holder with token; 0: not known
	// deadline is the Deadline this Backend last reported for the lease
	// of token on etcd lease lease (zero: none): what List reports for it.
	deadline time.Time
	// holdLease is the etcd lease of the min-hold key of token (0: none
	// or not known), and holdUntil the end of that hold this Backend
	// reported at the grant (zero: not known).
	holdLease clientv3.LeaseID
	holdUntil time.Time
	// holdUnread: the read this record came from did not read the
	// min-hold key (a renewal's check), so it says nothing of the hold.
	holdUnread bool
}

// maxSeen bounds the hint cache: past it an arbitrary entry is dropped,
// which costs that key one extra round trip on its next grant.
const maxSeen = 8192

var (
	_ sqllock.Backend = (*Backend)(nil)
	_ sqllock.Watcher = (*Backend)(nil)
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
		spares: make(map[int64][]spare), granted: make(map[int64]int64)}
	b.watch.b = b
	b.ka.cli = cli
	return b, nil
}

// Prefix returns the etcd key prefix the backend uses.
func (b *Backend) Prefix() string { return b.prefix }

// The etcd keys of lock key k (see the package doc).
func (b *Backend) tokenKey(k string) string   { return b.prefix + "t/" + k }
func (b *Backend) holderKey(k string) string  { return b.prefix + "h/" + k }
func (b *Backend) releaseKey(k string) string { return b.prefix + "r/" + k }
func (b *Backend) holdKey(k string) string    { return b.prefix + "m/" + k }

// tokenRecord is the value of <prefix>t/K.
type tokenRecord struct {
	Token int64  `json:"token"`
	Owner string `json:"owner"`
	Value []byte `json:"value,omitempty"` // base64 in JSON
}

// releaseRecord is the value of <prefix>r/K.
type releaseRecord struct {
	Token int64  `json:"token"`
	By    string `json:"by"`
}

// holdRecord is the value of <prefix>m/K: the grant whose min hold it
// keeps.
type holdRecord struct {
	Token int64  `json:"token"`
	Owner string `json:"owner"`
}

// holdValue is the min-hold key's value for the grant of token to owner.
func holdValue(token int64, owner string) string {
	v, _ := json.Marshal(holdRecord{Token: token, Owner: owner}) // cannot fail: an int and a string
	return string(v)
}

// keyState is one key's etcd keys, read at one revision.
type keyState struct {
	rec    tokenRecord
	recRev int64 // mod revision of the token record; 0 when absent
	holder *mvccpb.KeyValue
	rel    releaseRecord
	relRev int64 // mod revision of the release record; 0 when absent
	// hold is the min-hold key (nil when absent or not read); it only
	// ever carries the current token, since a grant requires it absent.
	hold       *mvccpb.KeyValue
	holdUnread bool // the read did not include the min-hold key
}

// released reports whether the current token was released.
func (s keyState) released() bool { return s.relRev != 0 && s.rel.Token == s.rec.Token }

// held reports whether the current grant is held and unexpired by etcd.
func (s keyState) held() bool {
	return s.holder != nil && string(s.holder.Value) == tokenString(s.rec.Token)
}

// taken reports whether no grant can be made: the current grant is held,
// or its min hold has not ended (by etcd's expiry of the hold's lease),
// released or not.
func (s keyState) taken() bool { return s.held() || s.hold != nil }

// sqllock returns the state as every backend describes it.
func (s keyState) sqllock() sqllock.KeyState {
	if s.recRev == 0 {
		return sqllock.KeyState{}
	}
	ks := sqllock.KeyState{Found: true, Token: s.rec.Token, Held: !s.released(), Owner: s.rec.Owner}
	if s.released() {
		ks.Owner = s.rel.By
	} else {
		ks.Expired = !s.held()
	}
	return ks
}

func (s keyState) seen() seenRecord {
	r := seenRecord{rev: s.recRev, token: s.rec.Token, held: s.taken(), holdUnread: s.holdUnread}
	if s.held() {
		r.lease = clientv3.LeaseID(s.holder.Lease)
	}
	if s.hold != nil {
		r.holdLease = clientv3.LeaseID(s.hold.Lease)
	}
	return r
}

// readOps are the operations that read what a renewal needs of a key's
// state, in the order parseState expects: the token record, the holder,
// the release record.
func (b *Backend) readOps(key string) []clientv3.Op {
	return []clientv3.Op{
		clientv3.OpGet(b.tokenKey(key)),
		clientv3.OpGet(b.holderKey(key)),
		clientv3.OpGet(b.releaseKey(key)),
	}
}

// stateOps are readOps and the min-hold key: the whole state, which a
// grant and a release decide on.
func (b *Backend) stateOps(key string) []clientv3.Op {
	return append(b.readOps(key), clientv3.OpGet(b.holdKey(key)))
}

func parseState(key string, rs []*etcdserverpb.ResponseOp) (keyState, error) {
	var s keyState
	if len(rs) != 3 && len(rs) != 4 {
		return s, fmt.Errorf("sqllock/etcd: %q: %d responses to a state read, want 3 or 4", key, len(rs))
	}
	s.holdUnread = len(rs) == 3
	if !s.holdUnread {
		if kvs := rs[3].GetResponseRange().GetKvs(); len(kvs) > 0 {
			s.hold = kvs[0]
		}
	}
	if kvs := rs[0].GetResponseRange().GetKvs(); len(kvs) > 0 {
		if err := json.Unmarshal(kvs[0].Value, &s.rec); err != nil {
			return s, fmt.Errorf("sqllock/etcd: %q: corrupt token record %q: %w", key, kvs[0].Value, err)
		}
		s.recRev = kvs[0].ModRevision
	}
	if kvs := rs[1].GetResponseRange().GetKvs(); len(kvs) > 0 {
		s.holder = kvs[0]
	}
	if kvs := rs[2].GetResponseRange().GetKvs(); len(kvs) > 0 {
		if err := json.Unmarshal(kvs[0].Value, &s.rel); err != nil {
			return s, fmt.Errorf("sqllock/etcd: %q: corrupt release record %q: %w", key, kvs[0].Value, err)
		}
		s.relRev = kvs[0].ModRevision
	}
	return s, nil
}

// read reads key's state in one linearizable, read-only transaction.
func (b *Backend) read(ctx context.Context, o op, key string) (keyState, error) {
	resp, err := b.cli.Txn(ctx).Then(b.stateOps(key)...).Commit()
	if err != nil {
		return keyState{}, translate(ctx, o.read(), key, err)
	}
	s, err := parseState(key, resp.Responses)
	if err == nil {
		b.remember(key, s.seen())
	}
	return s, err
}

func (b *Backend) remember(key string, s seenRecord) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if old, ok := b.seen[key]; ok && old.token == s.token {
		// A read does not know the deadlines reported.
		if s.deadline.IsZero() && old.lease == s.lease {
			s.deadline = old.deadline
		}
		switch {
		case s.holdUnread:
			s.holdLease, s.holdUntil = old.holdLease, old.holdUntil
		case s.holdUntil.IsZero() && old.holdLease == s.holdLease:
			s.holdUntil = old.holdUntil
		}
	}
	s.holdUnread = false
	if _, ok := b.seen[key]; !ok && len(b.seen) >= maxSeen {
		for k := range b.seen {
			delete(b.seen, k)
			break
		}
	}
	b.seen[key] = s
}

// rememberLease records that the holder of key with token is on etcd lease
// id (0: not known) with the Deadline this Backend reported for it (zero:
// none), if the record seen is of that token.
func (b *Backend) rememberLease(key string, token int64, id clientv3.LeaseID, deadline time.Time) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if r, ok := b.seen[key]; ok && r.token == token {
		r.lease, r.deadline = id, deadline
		b.seen[key] = r
	}
}

// leaseHint is the etcd lease that l's holder was last seen on; 0 when not
// known.
func (b *Backend) leaseHint(l sqllock.Lease) clientv3.LeaseID {
	r := b.recall(l.Key)
	if r.token != l.Token {
		return 0
	}
	return r.lease
}

func (b *Backend) recall(key string) seenRecord {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.seen[key]
}

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

// cloneValue is v, nil when empty: a value is nil for none.
func cloneValue(v []byte) []byte {
	if len(v) == 0 {
		return nil
	}
	return append([]byte(nil), v...)
}

// tokenString is a token as the holder key's value.
func tokenString(token int64) string { return strconv.FormatInt(token, 10) }

// ttlSeconds rounds ttl up to whole seconds: etcd's lease resolution.
func ttlSeconds(ttl time.Duration) int64 {
	return int64((ttl + time.Second - 1) / time.Second)
}

// maxAttempts bounds a grant's transactions when the token record keeps
// changing under it (grants and releases by others between two attempts).
const maxAttempts = 8

// TryAcquire implements [sqllock.Backend]. A grant costs a lease grant and
// one transaction (see the package doc for the other cases).
func (b *Backend) TryAcquire(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	if err := req.Validate(); err != nil {
		return sqllock.Lease{}, err
	}
	if err := ctx.Err(); err != nil {
		return sqllock.Lease{}, notSent(opAcquire, req.Key, err)
	}
	seen := b.recall(req.Key)
	if seen.held {
		// A waiter polls a key it saw held: read first, so that a refused
		// attempt writes nothing (no lease grant, no transaction).
		s, err := b.read(ctx, opAcquire, req.Key)
		if err != nil {
			return sqllock.Lease{}, err
		}
		if s.taken() && !(s.held() && s.rec.Owner == req.Owner) {
			return sqllock.Lease{}, b.refusal(ctx, req.Key, s)
		}
		seen = s.seen()
	}
	sent := time.Now()
	grant, hold, err := b.grantLeases(ctx, req, sent)
	if err != nil {
		return sqllock.Lease{}, err
	}
	lease := sqllock.Lease{Key: req.Key, Owner: req.Owner, BackendTime: sent, Deadline: sent.Add(time.Duration(max(grant.ttl, hold.ttl)) * time.Second)}
	for range maxAttempts {
		if seen.token == math.MaxInt64 {
			b.putSpare(hold)
			return b.exhausted(ctx, lease, grant)
		}
		token := seen.token + 1
		rec, err := json.Marshal(tokenRecord{Token: token, Owner: req.Owner, Value: req.Value})
		if err != nil {
			return sqllock.Lease{}, err
		}
		if err := ctx.Err(); err != nil {
			return sqllock.Lease{}, notSent(opAcquire, req.Key, err)
		}
		puts := []clientv3.Op{
			clientv3.OpPut(b.tokenKey(req.Key), string(rec)),
			clientv3.OpPut(b.holderKey(req.Key), tokenString(token), clientv3.WithLease(grant.id)),
		}
		var until time.Time
		if hold.id != 0 {
			puts = append(puts, clientv3.OpPut(b.holdKey(req.Key), holdValue(token, req.Owner), clientv3.WithLease(hold.id)))
			until = sent.Add(time.Duration(hold.ttl) * time.Second)
		}
		resp, err := b.cli.Txn(ctx).If(
			clientv3.Compare(clientv3.CreateRevision(b.holderKey(req.Key)), "=", 0),
			clientv3.Compare(clientv3.CreateRevision(b.holdKey(req.Key)), "=", 0),
			clientv3.Compare(clientv3.ModRevision(b.tokenKey(req.Key)), "=", seen.rev),
		).Then(puts...).Else(b.stateOps(req.Key)...).Commit()
		if err != nil {
			// Neither etcd lease is kept as a spare: a key may be on it.
			return sqllock.Lease{}, translate(ctx, opAcquire, req.Key, err)
		}
		if resp.Succeeded {
			b.remember(req.Key, seenRecord{rev: resp.Header.Revision, token: token, lease: grant.id,
				deadline: sent.Add(time.Duration(grant.ttl) * time.Second), holdLease: hold.id, holdUntil: until})
			lease.Token, lease.Value = token, cloneValue(req.Value)
			return lease, nil
		}
		s, err := parseState(req.Key, resp.Responses)
		if err != nil {
			return sqllock.Lease{}, err
		}
		b.remember(req.Key, s.seen())
		if s.taken() {
			b.putSpare(hold) // a repeat keeps its first grant's hold
			if s.held() && s.rec.Owner == req.Owner {
				lease.Deadline = sent.Add(time.Duration(grant.ttl) * time.Second)
				return b.regrant(ctx, lease, s, grant)
			}
			b.putSpare(grant)
			return sqllock.Lease{}, b.refusal(ctx, req.Key, s)
		}
		// Free, but the token record changed since this Backend saw it:
		// try again on the record just read.
		seen = s.seen()
	}
	b.putSpare(grant)
	b.putSpare(hold)
	return sqllock.Lease{}, fmt.Errorf("sqllock/etcd: acquire %q: %w: the key changed under %d attempts in a row", req.Key, sqllock.ErrUnavailable, maxAttempts)
}

// exhausted answers an acquire of a key whose token reached the largest
// int64: refused if held by another, the same grant for its own repeat,
// else ErrTokenExhausted.
func (b *Backend) exhausted(ctx context.Context, lease sqllock.Lease, sp spare) (sqllock.Lease, error) {
	s, err := b.read(ctx, opAcquire, lease.Key)
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
		clientv3.OpPut(b.holderKey(lease.Key), token, clientv3.WithLease(sp.id)),
	).Else(b.stateOps(lease.Key)...).Commit()
	if err != nil {
		return sqllock.Lease{}, translate(ctx, opAcquire, lease.Key, err)
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
			return spare{}, translate(ctx, opGrant, key, err)
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
		return spare{}, translate(ctx, opGrant, key, err)
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
		return sqllock.Lease{}, notSent(opRenew, l.Key, err)
	}
	want := ttlSeconds(ttl)
	id := b.leaseHint(l)
	for range maxAttempts {
		if id == 0 {
			// Which etcd lease the holder is on: this read is not the
			// check, which follows the keep-alive.
			s, err := b.read(ctx, opRenew, l.Key)
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
			return sqllock.Lease{}, translate(ctx, opRenew, l.Key, err)
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

// check reads, in one linearizable read-only transaction, whether l's
// holder key carries its token on etcd lease id; if not, the key's state.
func (b *Backend) check(ctx context.Context, l sqllock.Lease, id clientv3.LeaseID) (keyState, bool, error) {
	resp, err := b.cli.Txn(ctx).If(
		b.holds(l),
		clientv3.Compare(clientv3.LeaseValue(b.holderKey(l.Key)), "=", id),
	).Else(b.readOps(l.Key)...).Commit()
	if err != nil {
		return keyState{}, false, translate(ctx, opRenew, l.Key, err)
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
		return sqllock.Lease{}, translate(ctx, opGrant, l.Key, err)
	}
	resp, err := b.cli.Txn(ctx).If(
		b.holds(l),
		clientv3.Compare(clientv3.LeaseValue(b.holderKey(l.Key)), "=", id),
	).Then(
		clientv3.OpPut(b.holderKey(l.Key), tokenString(l.Token), clientv3.WithLease(grant.ID)),
	).Else(b.readOps(l.Key)...).Commit()
	if err != nil {
		// A renew keeps the token: repeating it is safe, so its unknown
		// outcome is merely unavailable.
		return sqllock.Lease{}, translate(ctx, opRenew, l.Key, err)
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

// Release implements [sqllock.Backend]: one transaction that deletes the
// holder and records who released, iff l's token holds the key. The
// min-hold key of l's grant stays when its owner releases (the key stays
// taken until etcd expires the hold's lease), and goes when another owner
// does (a forced release ends the hold at once).
func (b *Backend) Release(ctx context.Context, l sqllock.Lease) error {
	if err := sqllock.ValidateLease(l); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return notSent(opRelease, l.Key, err)
	}
	rel, err := json.Marshal(releaseRecord{Token: l.Token, By: l.Owner})
	if err != nil {
		return err
	}
	resp, err := b.cli.Txn(ctx).If(
		b.holds(l),
	).Then(
		clientv3.OpDelete(b.holderKey(l.Key), clientv3.WithPrevKV()),
		clientv3.OpPut(b.releaseKey(l.Key), string(rel)),
		b.endHold(l),
	).Else(b.stateOps(l.Key)...).Commit()
	if err != nil {
		return translate(ctx, opRelease, l.Key, err)
	}
	if resp.Succeeded {
		b.rememberLease(l.Key, l.Token, 0, time.Time{})
		// The etcd lease is left without a key: kept for reuse (its TTL
		// period began no earlier than l's BackendTime), else it expires
		// by itself; a revoke would cost a raft write for nothing.
		if prev := resp.Responses[0].GetResponseDeleteRange().GetPrevKvs(); len(prev) == 1 && prev[0].Lease != 0 {
			if ttl := l.Deadline.Sub(l.BackendTime); ttl > 0 && ttl%time.Second == 0 && !l.BackendTime.IsZero() {
				b.putSpare(spare{id: clientv3.LeaseID(prev[0].Lease), ttl: int64(ttl / time.Second), at: l.BackendTime})
			}
		}
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
			return translate(ctx, opRelease, l.Key, err)
		}
		if resp.Succeeded {
			return lost
		}
	}
	return fmt.Errorf("sqllock/etcd: release %q: %w: the key changed under %d attempts in a row", l.Key, sqllock.ErrUnavailable, maxAttempts)
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

func lostOrNil(lost *sqllock.LostError) error {
	if lost == nil {
		return nil
	}
	return lost
}

// List implements [sqllock.Backend]: one read-only transaction reads the
// three key ranges at one revision. A held key whose lease this Backend
// granted or renewed last reports the Deadline it reported then; any other
// held key's remaining time is one more round trip (etcd's lease
// time-to-live, in whole seconds).
func (b *Backend) List(ctx context.Context, prefix string) ([]sqllock.LockInfo, error) {
	if err := sqllock.ValidatePrefix(prefix); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, notSent(opList, prefix, err)
	}
	resp, err := b.cli.Txn(ctx).Then(
		clientv3.OpGet(b.tokenKey(prefix), clientv3.WithPrefix()),
		clientv3.OpGet(b.holderKey(prefix), clientv3.WithPrefix()),
		clientv3.OpGet(b.releaseKey(prefix), clientv3.WithPrefix()),
		clientv3.OpGet(b.holdKey(prefix), clientv3.WithPrefix()),
	).Commit()
	if err != nil {
		return nil, translate(ctx, opList, prefix, err)
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
		}
		out = append(out, info)
	}
	// etcd returns keys in byte order, which is the order of the suffixes
	// too; sort all the same, as the contract says key order.
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out, nil
}
