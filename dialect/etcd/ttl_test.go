package etcd

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

func TestTTLSecondsRoundUp(t *testing.T) {
	t.Parallel()
	for ttl, want := range map[time.Duration]int64{
		time.Millisecond: 1, 200 * time.Millisecond: 1, time.Second: 1,
		time.Second + time.Nanosecond: 2, 2500 * time.Millisecond: 3, sqllock.MaxTTL: 86400,
	} {
		require.Equal(t, want, ttlSeconds(ttl), "ttlSeconds(%v)", ttl)
	}
}

// TestEtcdExpiryNotBeforeLocalDeadline: the etcd lease of a grant and of a
// renewal outlives send time + TTL (so also the client's local deadline,
// which is that minus the margin): the TTL is rounded up, never down, and
// the etcd lease starts only after the request was sent. Each case holds
// without renewing until send time + TTL, then checks that etcd still
// holds the key. It also reports what etcd grants for short TTLs.
func TestEtcdExpiryNotBeforeLocalDeadline(t *testing.T) {
	t.Parallel()
	b := newBundle(t).backend
	ctx := testCtx(t)
	ttls := []time.Duration{200 * time.Millisecond, time.Second, 1500 * time.Millisecond, 2500 * time.Millisecond}
	var (
		mu      sync.Mutex
		granted []string
		wg      sync.WaitGroup
	)
	for i, ttl := range ttls {
		for _, mode := range []string{"fresh", "renewed", "reused"} {
			key := fmt.Sprintf("k%d-%s", i, mode)
			renew := mode == "renewed"
			b := b
			if mode == "reused" {
				b = newBundle(t).backend // its own, so that no other case takes its spare
			}
			wg.Go(func() {
				if mode == "reused" {
					// A released lease's etcd lease is kept and reused by
					// the next acquire of the same TTL: it must start its
					// TTL again (a keep-alive) after that acquire was sent.
					l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key + "-pre", TTL: ttl, Owner: "o"})
					if err == nil {
						err = b.Release(ctx, l)
					}
					if err != nil {
						t.Errorf("%v: %v", ttl, err)
						return
					}
					// Long enough that, without the keep-alive, etcd expires it
					// (checking every 500 ms) before send time + TTL: a spare
					// is reused while a second of its TTL is left (3 s for 2.5 s).
					time.Sleep(1500 * time.Millisecond)
				}
				sent := time.Now()
				l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: ttl, Owner: "o"})
				if err != nil {
					t.Errorf("%v: %v", ttl, err)
					return
				}
				if renew {
					sent = time.Now()
					if l, err = b.TryRenew(ctx, l, ttl); err != nil {
						t.Errorf("%v: renew: %v", ttl, err)
						return
					}
				}
				got := l.Deadline.Sub(l.BackendTime)
				if got < ttl || got%time.Second != 0 {
					t.Errorf("%v: granted %v, want whole seconds >= the TTL", ttl, got)
				}
				if mode == "fresh" {
					mu.Lock()
					granted = append(granted, fmt.Sprintf("%v->%v", ttl, got))
					mu.Unlock()
				}
				time.Sleep(time.Until(sent.Add(ttl)))
				resp, err := b.cli.Get(ctx, b.holderKey(key))
				if err != nil {
					t.Errorf("%v: %v", ttl, err)
					return
				}
				if len(resp.Kvs) == 0 {
					t.Errorf("%v (%s): etcd ended the lease before send time + TTL", ttl, mode)
				}
			})
		}
	}
	wg.Wait()
	t.Logf("etcd TTLs granted: %s", strings.Join(granted, " "))
}

// TestWatchSignalsExpiry: etcd's own expiry of a lease deletes the holder,
// which wakes the key's watchers (not only a release does).
func TestWatchSignalsExpiry(t *testing.T) {
	t.Parallel()
	b := newBundle(t).backend
	ctx := testCtx(t)
	ch, stop := b.Watch("k")
	defer stop()
	l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Second, Owner: "o"})
	require.NoError(t, err)
	select { // the signal of the watch being set up
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatal("no signal of the watch being set up")
	}
	select {
	case <-ch:
		t.Fatal("a signal before the lease could expire")
	default:
	}
	begin := time.Now()
	select {
	case <-ch:
	case <-time.After(l.Deadline.Sub(l.BackendTime) + 5*time.Second):
		t.Fatal("no signal after etcd expired the lease")
	}
	_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Second, Owner: "o2"})
	require.NoError(t, err, "signalled after %v, and the key is free", time.Since(begin))
}
