package etcd

import (
	"context"
	"encoding/json"
	"fmt"
	"strconv"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// seenRecord is what this Backend last saw of a key: the token record's
// revision and token (so that a grant's transaction can compare and
// increment without reading first), whether the key was held then (so
// that a waiter's next attempt reads before it grants a lease), and the
// etcd lease its holder is on (so that a renewal sends its keep-alive
// first; the check after it decides).
type seenRecord struct {
	rev   int64 // the token record's mod revision; 0: no record
	token int64
	// shared: the token record at rev was written by a reader's grant
	// (it has no owner), so readers may hold the key (see shared.go).
	shared bool
	held   bool
	lease  clientv3.LeaseID // the etcd lease of the holder with token; 0: not known
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
// which costs that key one extra round trip on its next grant (a failed
// transaction, a raft write) and a read on its next renewal. Sized for
// tens of thousands of keys in use (10,000 leases held on one Client, a
// workload of 10,000 keys) at about a hundred bytes each.
const maxSeen = 1 << 16

// The etcd keys of lock key k (see the package doc).
func (b *Backend) tokenKey(k string) string { return b.prefix + "t/" + k }

func (b *Backend) holderKey(k string) string { return b.prefix + "h/" + k }

func (b *Backend) releaseKey(k string) string { return b.prefix + "r/" + k }

func (b *Backend) holdKey(k string) string { return b.prefix + "m/" + k }

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
	// Lease is the etcd lease the released holder was on, and TTL the
	// lease's TTL in whole seconds (0: not known): when the released
	// lease ended, for a reap (see releaseRec).
	Lease clientv3.LeaseID `json:"lease,omitempty"`
	TTL   int64            `json:"ttl,omitempty"`
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
	r := seenRecord{rev: s.recRev, token: s.rec.Token, held: s.taken(), holdUnread: s.holdUnread,
		shared: s.recRev != 0 && s.rec.Owner == ""}
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
func (b *Backend) read(ctx context.Context, o outcome.Op, key string) (keyState, error) {
	resp, err := b.cli.Txn(ctx).Then(b.stateOps(key)...).Commit()
	if err != nil {
		return keyState{}, translate(ctx, o.Read(), key, err)
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

// cloneValue is v, nil when empty: a value is nil for none.
func cloneValue(v []byte) []byte {
	if len(v) == 0 {
		return nil
	}
	return append([]byte(nil), v...)
}

// tokenString is a token as the holder key's value.
func tokenString(token int64) string { return strconv.FormatInt(token, 10) }

// semCache is what a Backend knows of its semaphores: which limits it has
// seen stored, and which owners it granted a permit to (or whose acquire's
// outcome it does not know) and has not seen release it.
type semCache struct {
	limits map[string]int             // semaphore → its stored limit
	owners map[string]map[string]bool // semaphore → owners
}

func (b *Backend) knowLimit(sem string, n int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.sems.limits == nil {
		b.sems.limits = make(map[string]int)
	}
	if _, ok := b.sems.limits[sem]; !ok && len(b.sems.limits) >= maxSeen {
		clear(b.sems.limits)
	}
	b.sems.limits[sem] = n
}

func (b *Backend) limitKnown(sem string, n int) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.sems.limits[sem] == n
}

func (b *Backend) forgetLimit(sem string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.sems.limits, sem)
}

// notePermit records that owner may hold a permit of sem, granted (or
// maybe granted) by this Backend: its next request reads first.
func (b *Backend) notePermit(sem, owner string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.sems.owners == nil {
		b.sems.owners = make(map[string]map[string]bool)
	}
	if len(b.sems.owners) >= maxSeen && b.sems.owners[sem] == nil {
		clear(b.sems.owners) // past the bound: a retry may take a second permit (see the package doc)
	}
	o := b.sems.owners[sem]
	if o == nil {
		o = make(map[string]bool)
		b.sems.owners[sem] = o
	}
	if len(o) >= maxSeen {
		clear(o)
	}
	o[owner] = true
}

func (b *Backend) maybeHoldsPermit(sem, owner string) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.sems.owners[sem][owner]
}

func (b *Backend) forgetPermit(sem, owner string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	if o := b.sems.owners[sem]; o != nil {
		delete(o, owner)
		if len(o) == 0 {
			delete(b.sems.owners, sem)
		}
	}
}

// releasedPermit, when l is a permit's lease, forgets that l's owner
// holds a permit, and notes the permit free: the next acquire's chain
// tries it first.
func (b *Backend) releasedPermit(l sqllock.Lease) {
	sem, _, ok := sqllock.ParsePermitKey(l.Key)
	if !ok {
		return
	}
	b.forgetPermit(sem, l.Owner)
	b.mu.Lock()
	defer b.mu.Unlock()
	if r, ok := b.seen[l.Key]; ok && r.token == l.Token {
		r.held = false
		b.seen[l.Key] = r
	}
}
