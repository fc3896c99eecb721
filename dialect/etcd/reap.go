package etcd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

var _ sqllock.Reaper = (*Backend)(nil)

// The floor: <prefix>floor holds, in decimal, at least the largest token
// of every key ever reaped. A reap raises it in the transaction that
// deletes the keys, comparing its revision; a key's first grant (no token
// record) takes floor + 1 and compares the floor's revision unchanged, so
// a reap that lands between the grant's reads and its transaction fails
// the grant's compares, and the grant tries again above the new floor.

func (b *Backend) floorKey() string { return b.prefix + "floor" }

// floorHint is what this Backend last saw of the floor: its value and mod
// revision (0, 0: absent, as before any reap).
type floorHint struct{ value, rev int64 }

func (b *Backend) floorSeen() floorHint {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.floor
}

// noteFloor records the floor read in kvs (a range of the floor key).
func (b *Backend) noteFloor(kvs []*mvccpb.KeyValue) (floorHint, error) {
	var f floorHint
	if len(kvs) > 0 {
		v, err := strconv.ParseInt(string(kvs[0].Value), 10, 64)
		if err != nil || v < 0 {
			return f, fmt.Errorf("sqllock/etcd: corrupt token floor %q", kvs[0].Value)
		}
		f = floorHint{value: v, rev: kvs[0].ModRevision}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.floor = f
	return f, nil
}

// firstGrantCmp is the compare a key's first grant adds: the floor it
// read is still the floor.
func (b *Backend) firstGrantCmp(f floorHint) clientv3.Cmp {
	return clientv3.Compare(clientv3.ModRevision(b.floorKey()), "=", f.rev)
}

// The clock. etcd has no time function a transaction can compare, and a
// client's clock is not etcd's; what etcd does time is its leases, by its
// leader's clock. A clock entry <prefix>c/<R> (R zero-padded) names an
// etcd lease granted after revision R was read, and the TTL it was granted
// with; the lease has no key. Its age by etcd's clock, the granted TTL less
// what etcd says is left (less one second: etcd rounds what is left down),
// or at least the granted TTL once etcd no longer knows it, is then a lower
// bound of the time since every revision up to R was committed. A leader
// change only extends leases: the bound stays a lower one.

func (b *Backend) clockPrefix() string { return b.prefix + "c/" }

type clockEntry struct {
	rev   int64            // revisions up to rev were committed before the lease was granted
	Lease clientv3.LeaseID `json:"lease"`
	TTL   int64            `json:"ttl"` // seconds, as granted
	age   time.Duration    // by etcd's lease clock, at least (computed per reap)
}

// clockKeep is how many clock entries a reap leaves: the newest ones.
const clockKeep = 16

// clock is the clock's entries, oldest first, with their ages, and the
// revision at which they were read.
type clock struct {
	entries []clockEntry
	now     int64
}

// readClock reads the clock, ages its entries, starts a new entry when
// the newest is older than olderThan/4 (or there is none), and drops all
// but the newest clockKeep entries.
func (b *Backend) readClock(ctx context.Context, olderThan time.Duration) (clock, error) {
	resp, err := b.cli.Get(ctx, b.clockPrefix(), clientv3.WithPrefix())
	if err != nil {
		return clock{}, translate(ctx, outcome.Reap.Read(), "", err)
	}
	c := clock{now: resp.Header.Revision}
	for _, kv := range resp.Kvs {
		var e clockEntry
		rev, perr := strconv.ParseInt(strings.TrimPrefix(string(kv.Key), b.clockPrefix()), 10, 64)
		if perr != nil || json.Unmarshal(kv.Value, &e) != nil {
			return clock{}, fmt.Errorf("sqllock/etcd: corrupt clock entry %q = %q", kv.Key, kv.Value)
		}
		e.rev = rev
		ttl, err := b.cli.TimeToLive(ctx, e.Lease)
		switch {
		case err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound):
			return clock{}, translate(ctx, outcome.Reap.Read(), "", err)
		case err != nil || ttl.TTL < 0:
			e.age = time.Duration(e.TTL) * time.Second // gone: expired
		default:
			e.age = max(0, time.Duration(ttl.GrantedTTL-ttl.TTL-1)*time.Second)
		}
		c.entries = append(c.entries, e)
	}
	if n := len(c.entries); n == 0 || c.entries[n-1].age >= olderThan/4 {
		// Revisions up to c.now were committed before this grant is sent.
		ttl := int64(min(max(2*olderThan, time.Hour)/time.Second, maxLeaseTTL))
		g, err := b.cli.Grant(ctx, ttl)
		if err != nil {
			return clock{}, translate(ctx, outcome.Grant, "", err)
		}
		v, _ := json.Marshal(clockEntry{Lease: g.ID, TTL: g.TTL}) // cannot fail: two ints
		if _, err := b.cli.Put(ctx, fmt.Sprintf("%s%020d", b.clockPrefix(), c.now), string(v)); err != nil {
			return clock{}, translate(ctx, outcome.Reap, "", err)
		}
	}
	if n := len(c.entries); n > clockKeep {
		end := fmt.Sprintf("%s%020d", b.clockPrefix(), c.entries[n-clockKeep].rev)
		if _, err := b.cli.Delete(ctx, b.clockPrefix(), clientv3.WithRange(end)); err != nil {
			return clock{}, translate(ctx, outcome.Reap, "", err)
		}
	}
	return c, nil
}

// maxLeaseTTL is etcd's largest lease TTL, in seconds.
const maxLeaseTTL = 9_000_000_000

// before is the newest revision committed at least d ago by etcd's clock:
// the current revision for d = 0; 0 when the clock knows none.
func (c clock) before(d time.Duration) int64 {
	if d <= 0 {
		return c.now
	}
	for i := len(c.entries) - 1; i >= 0; i-- {
		if c.entries[i].age >= d {
			return c.entries[i].rev
		}
	}
	return 0
}

// reapPage is how many token records a reap reads at a time.
const reapPage = 500

// reapCompares is how many compares one key adds to a reap's transaction
// (its token record's revision, no holder, no min-hold key), and
// reapDeletes its deletes (the token record and the release record).
const reapCompares, reapDeletes = 3, 2

// Reap implements [sqllock.Reaper]: it deletes the token and release
// records of at most limit keys, in key order, whose lease ended at least
// olderThan ago by etcd's clock (see the package doc and
// docs/key-reaping.md), in transactions of at most MaxTxnOps operations
// that compare each key unchanged and free and raise the floor, comparing
// its revision. A semaphore's keys (containing "#permit") and reader
// slots (whose numbering is their key's own) are never reaped.
//
// When a key's lease ended: it is free (no holder, no min-hold key); a
// key released by its holder ended at its release plus the TTL the lease
// last had (recorded in the release record), or once etcd no longer knows
// the released etcd lease (recorded there too); a key that expired ended
// when etcd deleted its holder, known to be before revision R when
// neither its holder nor its min-hold key existed at R (a read of etcd's
// history) and the token record is older than R. So a reap with olderThan
// > 0 needs the clock to be older than olderThan: the first reap of a
// prefix starts it and deletes only what olderThan = 0 would find ended.
func (b *Backend) Reap(ctx context.Context, olderThan time.Duration, limit int) (int, error) {
	if err := sqllock.ValidateReap(olderThan, limit); err != nil {
		return 0, err
	}
	if err := ctx.Err(); err != nil {
		return 0, notSent(outcome.Reap, "", err)
	}
	clk, err := b.readClock(ctx, olderThan)
	if err != nil {
		return 0, err
	}
	var live map[clientv3.LeaseID]bool // etcd's leases, read when needed
	per := max(1, (b.maxOps-1)/reapCompares)
	from, end := b.tokenKey(""), clientv3.GetPrefixRangeEnd(b.tokenKey(""))
	deleted := 0
	for deleted < limit {
		if err := ctx.Err(); err != nil {
			return deleted, notSent(outcome.Reap, "", err)
		}
		page, err := b.cli.Get(ctx, from, clientv3.WithRange(end), clientv3.WithLimit(reapPage))
		if err != nil {
			return deleted, translate(ctx, outcome.Reap.Read(), "", err)
		}
		if len(page.Kvs) == 0 {
			return deleted, nil
		}
		cands, err := b.reapCandidates(ctx, page.Kvs, olderThan, clk, &live)
		if err != nil {
			return deleted, err
		}
		for len(cands) > 0 && deleted < limit {
			n := min(per, len(cands), limit-deleted)
			got, err := b.reapTxn(ctx, cands[:n])
			deleted += got
			if err != nil {
				return deleted, err
			}
			cands = cands[n:]
		}
		if !page.More {
			return deleted, nil
		}
		from = string(page.Kvs[len(page.Kvs)-1].Key) + "\x00"
	}
	return deleted, nil
}

// reapCandidate is a key a reap found ended: its token record's revision
// and token.
type reapCandidate struct {
	key   string
	rev   int64
	token int64
}

// reapCandidates are the keys of page (token records, in key order) whose
// lease ended at least olderThan ago.
func (b *Backend) reapCandidates(ctx context.Context, page []*mvccpb.KeyValue, olderThan time.Duration, clk clock, live *map[clientv3.LeaseID]bool) ([]reapCandidate, error) {
	first := strings.TrimPrefix(string(page[0].Key), b.tokenKey(""))
	last := strings.TrimPrefix(string(page[len(page)-1].Key), b.tokenKey(""))
	within := func(k func(string) string, opts ...clientv3.OpOption) clientv3.Op {
		// Through last's presence keys (see shared.go).
		return clientv3.OpGet(k(first), append([]clientv3.OpOption{clientv3.WithRange(k(last) + "\x01"), clientv3.WithKeysOnly()}, opts...)...)
	}
	ops := []clientv3.Op{
		within(b.holderKey),
		within(b.holdKey),
		clientv3.OpGet(b.releaseKey(first), clientv3.WithRange(b.releaseKey(last)+"\x00")),
	}
	expiredBefore := clk.before(olderThan)
	if olderThan > 0 && expiredBefore > 0 {
		// Holders and min holds as they were at expiredBefore.
		ops = append(ops, within(b.holderKey, clientv3.WithRev(expiredBefore)), within(b.holdKey, clientv3.WithRev(expiredBefore)))
	}
	resp, err := b.cli.Txn(ctx).Then(ops...).Commit()
	if errors.Is(err, rpctypes.ErrCompacted) {
		return nil, fmt.Errorf("sqllock/etcd: reap: %w: etcd compacted its history past revision %d (committed %v ago or more), which a reap of keys expired %v ago reads: reap more often than the compaction, or with a shorter olderThan", sqllock.ErrUnavailable, expiredBefore, olderThan, olderThan)
	}
	if err != nil {
		return nil, translate(ctx, outcome.Reap.Read(), "", err)
	}
	keysOf := func(i int, k func(string) string) map[string]bool {
		m := make(map[string]bool)
		for _, kv := range resp.Responses[i].GetResponseRange().GetKvs() {
			name := strings.TrimPrefix(string(kv.Key), k(""))
			if at := strings.IndexByte(name, 0); at >= 0 {
				name = name[:at] // a reader's presence key: its key is held shared
			}
			m[name] = true
		}
		return m
	}
	holders, holds := keysOf(0, b.holderKey), keysOf(1, b.holdKey)
	rels := make(map[string]*mvccpb.KeyValue)
	for _, kv := range resp.Responses[2].GetResponseRange().GetKvs() {
		rels[strings.TrimPrefix(string(kv.Key), b.releaseKey(""))] = kv
	}
	var heldThen, holdThen map[string]bool
	if len(resp.Responses) > 3 {
		heldThen, holdThen = keysOf(3, b.holderKey), keysOf(4, b.holdKey)
	}
	var out []reapCandidate
	for _, kv := range page {
		key := strings.TrimPrefix(string(kv.Key), b.tokenKey(""))
		if strings.Contains(key, "#permit") || holders[key] || holds[key] || isSlot(key) {
			continue // a semaphore's, not free (held, in its min hold, read), or a reader slot
		}
		var rec tokenRecord
		if err := json.Unmarshal(kv.Value, &rec); err != nil {
			return nil, fmt.Errorf("sqllock/etcd: corrupt token record %q: %w", kv.Key, err)
		}
		var rel releaseRecord
		relKV := rels[key]
		if relKV != nil {
			if err := json.Unmarshal(relKV.Value, &rel); err != nil {
				return nil, fmt.Errorf("sqllock/etcd: corrupt release record %q: %w", relKV.Key, err)
			}
		}
		ended := false
		switch {
		case relKV != nil && rel.Token == rec.Token && (rel.TTL > 0 || rel.Lease != 0):
			// Released: ended by its release + the lease's last TTL, or
			// once etcd no longer knows its etcd lease.
			if rel.TTL > 0 {
				if r := clk.before(olderThan + time.Duration(rel.TTL+1)*time.Second); r > 0 && relKV.ModRevision <= r {
					ended = true
					break
				}
			}
			if olderThan == 0 && rel.Lease != 0 {
				if *live == nil {
					ls, err := b.cli.Leases(ctx)
					if err != nil {
						return nil, translate(ctx, outcome.Reap.Read(), "", err)
					}
					*live = make(map[clientv3.LeaseID]bool, len(ls.Leases))
					for _, l := range ls.Leases {
						(*live)[l.ID] = true
					}
				}
				ended = !(*live)[rel.Lease]
			}
		case olderThan == 0:
			// Expired: etcd deleted its holder. (Or released by an
			// ashlock that did not record the lease: as though its
			// lease ended at the release.)
			ended = true
		default:
			ended = heldThen != nil && kv.ModRevision <= expiredBefore && !heldThen[key] && !holdThen[key] &&
				(relKV == nil || relKV.ModRevision <= expiredBefore)
		}
		if ended {
			out = append(out, reapCandidate{key: key, rev: kv.ModRevision, token: rec.Token})
		}
	}
	return out, nil
}

// reapTxn deletes cands' records in one transaction iff each is unchanged
// and free and the floor is as this Backend saw it, raising the floor to
// their largest token; on a changed floor it reads it and tries again. It
// returns how many keys it deleted.
func (b *Backend) reapTxn(ctx context.Context, cands []reapCandidate) (int, error) {
	for range maxAttempts {
		f := b.floorSeen()
		top := f.value
		cmps := []clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(b.floorKey()), "=", f.rev)}
		var dels []clientv3.Op
		for _, c := range cands {
			top = max(top, c.token)
			cmps = append(cmps,
				clientv3.Compare(clientv3.ModRevision(b.tokenKey(c.key)), "=", c.rev),
				clientv3.Compare(clientv3.CreateRevision(b.holderKey(c.key)), "=", 0),
				b.noHoldNorReaders(c.key))
			dels = append(dels, clientv3.OpDelete(b.tokenKey(c.key)), clientv3.OpDelete(b.releaseKey(c.key)))
		}
		dels = append(dels, clientv3.OpPut(b.floorKey(), strconv.FormatInt(top, 10)))
		resp, err := b.cli.Txn(ctx).If(cmps...).Then(dels...).Else(clientv3.OpGet(b.floorKey())).Commit()
		if err != nil {
			return 0, translate(ctx, outcome.Reap, cands[0].key, err)
		}
		if resp.Succeeded {
			b.mu.Lock()
			b.floor = floorHint{value: top, rev: resp.Header.Revision}
			for _, c := range cands {
				delete(b.seen, c.key)
			}
			b.mu.Unlock()
			return len(cands), nil
		}
		nf, err := b.noteFloor(resp.Responses[0].GetResponseRange().GetKvs())
		if err != nil {
			return 0, err
		}
		if nf == f {
			// A key changed since it was read (granted again, or
			// reaped by another): this batch is left to the next reap.
			return 0, nil
		}
	}
	return 0, fmt.Errorf("sqllock/etcd: reap: %w: the floor changed under %d attempts in a row", sqllock.ErrUnavailable, maxAttempts)
}

// releaseRec is the release record of l by its owner: with the etcd lease
// its holder was last seen on (0: not known) and its TTL in whole
// seconds, rounded up (0: not known), from which a reap tells when the
// released lease ended.
func releaseRec(l sqllock.Lease, seen seenRecord) releaseRecord {
	r := releaseRecord{Token: l.Token, By: l.Owner}
	if seen.token == l.Token {
		r.Lease = seen.lease
	}
	if !l.BackendTime.IsZero() && l.Deadline.After(l.BackendTime) {
		d := l.Deadline.Sub(l.BackendTime)
		r.TTL = int64(min((d+time.Second-1)/time.Second, math.MaxInt32))
	}
	return r
}

// isSlot reports whether key is a reader slot's.
func isSlot(key string) bool {
	_, _, ok := sqllock.ParseSharedKey(key)
	return ok
}
