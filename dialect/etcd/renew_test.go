package etcd

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/dialect/etcd/internal/etcdtest"
	"github.com/ashlock/ashlock/internal/testkit/etcdserver"
	"github.com/ashlock/ashlock/sqllock"
)

// holderLease is the etcd lease that key's holder key is attached to (0:
// no holder).
func holderLease(t testing.TB, b *Backend, key string) clientv3.LeaseID {
	t.Helper()
	resp, err := b.cli.Get(testCtx(t), b.holderKey(key))
	require.NoError(t, err)
	if len(resp.Kvs) == 0 {
		return 0
	}
	return clientv3.LeaseID(resp.Kvs[0].Lease)
}

// TestRenewalNotTrustedToKeepAlive plays an etcd with bug
// etcd-io/etcd#20547 (a keep-alive racing the revocation of an expired
// lease answers a positive TTL after the lease's keys were deleted): the
// lease is revoked just before the renewal's keep-alive reaches the
// server, and the reply says the TTL was restarted all the same. The
// renewal must be a loss (expired), since the key is free for the next
// holder, which gets it. A renewal that checks the holder before the
// keep-alive, and then trusts the keep-alive, reports it renewed.
func TestRenewalNotTrustedToKeepAlive(t *testing.T) {
	t.Parallel()
	for _, r := range renewers {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			testRenewalNotTrustedToKeepAlive(t, r.renew)
		})
	}
}

// renewers are the two ways a Backend renews: alone, and in a batch (of
// the lease and another, live one).
var renewers = []struct {
	name  string
	renew func(b *Backend, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error)
}{
	{"Single", func(b *Backend, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
		return b.TryRenew(context.Background(), l, ttl)
	}},
	{"Batch", func(b *Backend, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
		ctx := context.Background()
		other, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "batch-companion-" + l.Key, TTL: ttl, Owner: "c"})
		if err != nil {
			return sqllock.Lease{}, err
		}
		res, err := b.TryRenewBatch(ctx, []sqllock.RenewRequest{{Lease: other, TTL: ttl}, {Lease: l, TTL: ttl}})
		if err != nil {
			return sqllock.Lease{}, err
		}
		if res[0].Err != nil {
			return sqllock.Lease{}, fmt.Errorf("the live companion: %w", res[0].Err)
		}
		return res[1].Lease, res[1].Err
	}},
}

func testRenewalNotTrustedToKeepAlive(t *testing.T, renew func(*Backend, sqllock.Lease, time.Duration) (sqllock.Lease, error)) {
	b, calls, other := counted(t)
	ctx := testCtx(t)
	l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: 10 * time.Second, Owner: "o1"})
	require.NoError(t, err)
	id := holderLease(t, other, "k")
	require.NotZero(t, id)
	var revoked atomic.Int32
	calls.SetKeepAlive(func(got int64) int64 {
		if clientv3.LeaseID(got) != id || revoked.Load() != 0 {
			return 0
		}
		// etcd expires the lease now: its keys are deleted...
		if _, err := other.cli.Revoke(ctx, id); err != nil {
			t.Errorf("revoke: %v", err)
			return 0
		}
		revoked.Add(1)
		return 10 // ... and the keep-alive is answered with its TTL all the same
	})
	_, err = renew(b, l, 10*time.Second)
	calls.SetKeepAlive(nil)
	require.Equal(t, int32(1), revoked.Load(), "the renewal sent no keep-alive on the holder's etcd lease")
	var lost *sqllock.LostError
	require.True(t, errors.As(err, &lost), "a renewal reported on a keep-alive of a lease whose key is gone: %v", err)
	require.Equal(t, sqllock.LostExpired, lost.Reason)
	// The key is free: the next holder gets it, and only the loss above
	// keeps the two from holding it at once.
	l2, err := other.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: 10 * time.Second, Owner: "o2"})
	require.NoError(t, err)
	require.Equal(t, l.Token+1, l2.Token)
}

// TestRenewalKeepsTheHolderLeaseAlive: a renewal reports the TTL of the
// etcd lease that the holder key is attached to when the check runs, not
// of the one it expected. Here the holder was moved, with the same token,
// onto another etcd lease with a shorter TTL (as a repeated acquire of
// another Backend, or a renewal with a longer TTL, moves it): a renewal
// that checks only the token after keeping the old lease alive (a keyless
// one now) reports that lease's 30 s while the key's own lease, not kept
// alive, has 5 s.
func TestRenewalKeepsTheHolderLeaseAlive(t *testing.T) {
	t.Parallel()
	for _, r := range renewers {
		t.Run(r.name, func(t *testing.T) {
			t.Parallel()
			testRenewalKeepsTheHolderLeaseAlive(t, r.renew)
		})
	}
}

func testRenewalKeepsTheHolderLeaseAlive(t *testing.T, renew func(*Backend, sqllock.Lease, time.Duration) (sqllock.Lease, error)) {
	b, _, other := counted(t)
	ctx := testCtx(t)
	l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: 30 * time.Second, Owner: "o1"})
	require.NoError(t, err)
	short, err := other.cli.Grant(ctx, 5)
	require.NoError(t, err)
	resp, err := other.cli.Txn(ctx).If(other.holds(l)).Then(
		clientv3.OpPut(other.holderKey("k"), tokenString(l.Token), clientv3.WithLease(short.ID)),
	).Commit()
	require.NoError(t, err)
	require.True(t, resp.Succeeded)
	r, err := renew(b, l, 5*time.Second)
	if errors.Is(err, sqllock.ErrUnavailable) {
		// A batch leaves a holder found on another etcd lease to a
		// renewal of its own; the next one keeps that lease alive.
		r, err = renew(b, l, 5*time.Second)
	}
	require.NoError(t, err)
	reported := r.Deadline.Sub(r.BackendTime)
	require.Equal(t, short.ID, holderLease(t, other, "k"))
	ttl, err := other.cli.TimeToLive(ctx, short.ID)
	require.NoError(t, err)
	// etcd reports whole seconds, rounded down: a lease renewed for 5 s
	// just now reports 4 or 5.
	require.GreaterOrEqual(t, time.Duration(ttl.TTL+1)*time.Second, reported,
		"the renewal reported %v, but the holder key's etcd lease has %ds left", reported, ttl.TTL)
	require.Equal(t, 5*time.Second, reported)
}

// raceGrant is one grant in TestRenewalsRacingExpiry: its token, when its
// acquire was sent and answered, and when its release was sent (zero: it
// was left to expire).
type raceGrant struct {
	token            int64
	sent, recv, rel  time.Time
	holder, released bool
}

// raceClaim is a span in which the holder's backend said its lease holds:
// from the send time of its acquire or renewal to the Deadline it reported.
type raceClaim struct {
	token       int64
	from, until time.Time
}

// TestRenewalsRacingExpiry races renewals against etcd's expiry on the
// real server: a holder renews each lease at the edge of its TTL (etcd's
// minimum, on a server configured for a 1 s minimum), from 6 ms before
// the reported Deadline to 3 ms after it, while a second client polls the
// key to acquire it. A renewal reported by a server that deleted the key
// (etcd-io/etcd#20547) would let the poller in while the holder is told
// its lease holds. Checked: tokens per key exactly 1, 2, 3, ... over both
// clients' grants; no grant of a newer token answered before the end of a
// span the holder's backend reported held (anomalies 0); both outcomes,
// renewed and lost, seen.
func TestRenewalsRacingExpiry(t *testing.T) {
	t.Parallel()
	run := 8 * time.Second
	if os.Getenv("SQLLOCK_LONG") == "1" {
		run = 30 * time.Second
	}
	ctx := testCtx(t)
	// A 100 ms election timeout makes etcd's minimum TTL 1 s (it is
	// ceil(1.5 x election timeout) in whole seconds).
	cluster := startCluster(t, etcdserver.Options{HeartbeatMS: 20, ElectionMS: 100})
	newBackend := func() *Backend {
		cli, err := etcdtest.NewClient(cluster.Endpoints())
		require.NoError(t, err)
		t.Cleanup(func() { cli.Close() })
		b, err := New(cli, Options{Prefix: "race/"})
		require.NoError(t, err)
		return b
	}
	holder, poller := newBackend(), newBackend()
	const (
		keys = 12
		ttl  = time.Second
	)
	var (
		mu       sync.Mutex
		grants   = map[string][]raceGrant{}
		claims   = map[string][]raceClaim{}
		granted  = map[time.Duration]int{}
		renewed  atomic.Int64
		lost     atomic.Int64
		failed   atomic.Int64
		refused  atomic.Int64
		stop     = time.Now().Add(run)
		wg       sync.WaitGroup
		rejected = func(err error) bool { return errors.Is(err, sqllock.ErrNotAcquired) }
	)
	addGrant := func(key string, g raceGrant) {
		mu.Lock()
		defer mu.Unlock()
		grants[key] = append(grants[key], g)
	}
	addClaim := func(key string, l sqllock.Lease, from time.Time) {
		mu.Lock()
		defer mu.Unlock()
		claims[key] = append(claims[key], raceClaim{token: l.Token, from: from, until: l.Deadline})
		granted[l.Deadline.Sub(l.BackendTime)]++
	}
	for k := range keys {
		key := fmt.Sprintf("k%d", k)
		// The send time of the holder's latest acquire or renewal that
		// succeeded (unix nanos): etcd can expire the lease from a TTL
		// after it, whatever Deadline the backend reported.
		var last atomic.Int64
		wg.Go(func() { // the holder
			for n := 0; time.Now().Before(stop); n++ {
				sent := time.Now()
				l, err := holder.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: ttl, Owner: fmt.Sprintf("a/%s/%d", key, n)})
				if err != nil {
					if !rejected(err) {
						failed.Add(1)
					}
					time.Sleep(time.Millisecond)
					continue
				}
				g := raceGrant{token: l.Token, sent: sent, recv: time.Now(), holder: true}
				addClaim(key, l, sent)
				last.Store(sent.UnixNano())
				for i := 0; ; i++ {
					// From 6 ms before the Deadline to 3 ms after it, by
					// the key, the grant and the renewal.
					at := l.Deadline.Add(time.Duration((k*7+n*5+i*3)%10-6) * time.Millisecond)
					time.Sleep(time.Until(at))
					sent := time.Now()
					var r sqllock.Lease
					if (n+i)%2 == 0 {
						r, err = holder.TryRenew(ctx, l, ttl)
					} else {
						// A batch of one: the Client's renewals go this way.
						var res []sqllock.RenewResult
						if res, err = holder.TryRenewBatch(ctx, []sqllock.RenewRequest{{Lease: l, TTL: ttl}}); err == nil {
							r, err = res[0].Lease, res[0].Err
						}
					}
					if err == nil {
						renewed.Add(1)
						addClaim(key, r, sent)
						last.Store(sent.UnixNano())
						l = r
						if time.Now().Before(stop) {
							continue
						}
						g.rel, g.released = time.Now(), true
						if err := holder.Release(ctx, l); err != nil && !errors.Is(err, sqllock.ErrLeaseLost) {
							t.Errorf("%s: release: %v", key, err)
						}
					} else if errors.Is(err, sqllock.ErrLeaseLost) {
						lost.Add(1)
					} else {
						failed.Add(1)
						t.Logf("%s: renew: %v", key, err)
					}
					break
				}
				addGrant(key, g)
			}
		})
		wg.Go(func() { // the poller: from just before etcd can expire the holder's lease
			for n := 0; time.Now().Before(stop); n++ {
				e := time.Unix(0, last.Load()).Add(ttl)
				if now := time.Now(); now.Before(e.Add(-5*time.Millisecond)) || now.After(e.Add(700*time.Millisecond)) {
					time.Sleep(time.Millisecond)
					continue
				}
				sent := time.Now()
				l, err := poller.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: ttl, Owner: fmt.Sprintf("b/%s/%d", key, n)})
				if err != nil {
					if rejected(err) {
						refused.Add(1)
					} else {
						failed.Add(1)
					}
					time.Sleep(2 * time.Millisecond)
					continue
				}
				g := raceGrant{token: l.Token, sent: sent, recv: time.Now(), rel: time.Now(), released: true}
				if err := poller.Release(ctx, l); err != nil {
					g.released = false
				}
				addGrant(key, g)
			}
		})
	}
	wg.Wait()

	anomalies, pollerGrants := 0, 0
	for k := range keys {
		key := fmt.Sprintf("k%d", k)
		gs := grants[key]
		slices.SortFunc(gs, func(a, b raceGrant) int { return cmp.Compare(a.token, b.token) })
		for i, g := range gs {
			if g.token != int64(i+1) {
				anomalies++
				t.Errorf("%s: grant %d has token %d, want %d (tokens exactly +1)", key, i, g.token, i+1)
			}
			if g.holder {
				continue
			}
			pollerGrants++
			for _, c := range claims[key] {
				// The poller's grant happened no later than its reply, and
				// its tenure lasted at least until its release was sent.
				if g.token > c.token && g.recv.Before(c.until) && (!g.released || g.rel.After(c.from)) {
					anomalies++
					t.Errorf("%s: token %d granted (answered %v before the end) while token %d was reported held from %v to %v",
						key, g.token, c.until.Sub(g.recv), c.token, c.from.Format("15:04:05.000"), c.until.Format("15:04:05.000"))
				}
			}
		}
	}
	t.Logf("renewals at the edge: renewed %d, lost %d; poller grants %d, refused %d; errors %d; TTLs granted %v; anomalies %d",
		renewed.Load(), lost.Load(), pollerGrants, refused.Load(), failed.Load(), granted, anomalies)
	require.Zero(t, anomalies)
	require.Positive(t, renewed.Load(), "no renewal at the edge succeeded: the run did not race expiry")
	require.Positive(t, lost.Load(), "no renewal at the edge was lost: the run did not race expiry")
	require.Positive(t, pollerGrants, "the poller never got a key: the run did not race expiry")
}
