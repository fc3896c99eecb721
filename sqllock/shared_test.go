package sqllock_test

import (
	"context"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

var shared = &sqllock.AcquireOptions{Shared: true}

// TestAcquireShared: shared Guards hold a key together, each under its
// own reader slot with its own token, and are renewed as any Guard; an
// exclusive attempt is refused beside them, and granted once they left,
// with a token above theirs.
func TestAcquireShared(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b := memory.New()
		c := newPermitClient(t, b, sqllock.Options{TTL: 3 * time.Second})
		ctx := t.Context()
		g1, err := c.Acquire(ctx, "cfg", shared)
		require.NoError(t, err)
		g2, err := c.Acquire(ctx, "cfg", shared)
		require.NoError(t, err)
		require.NotEqual(t, g1.Key(), g2.Key())
		for _, g := range []*sqllock.Guard{g1, g2} {
			k, _, ok := sqllock.ParseSharedKey(g.Key())
			require.True(t, ok, g.Key())
			require.Equal(t, "cfg", k)
		}
		require.Greater(t, g2.Token(), g1.Token())

		other := newPermitClient(t, b, sqllock.Options{})
		_, err = other.TryAcquire(ctx, "cfg", nil)
		var he *sqllock.HeldError
		require.ErrorAs(t, err, &he)
		require.Equal(t, 2, he.Shared)

		time.Sleep(10 * time.Second) // many renewals: both still hold
		require.NoError(t, g1.Err())
		require.NoError(t, g2.Err())
		require.NoError(t, g1.Release(ctx))
		require.NoError(t, g2.Release(ctx))
		w, err := other.TryAcquire(ctx, "cfg", nil)
		require.NoError(t, err)
		require.Greater(t, w.Token(), g2.Token())
		require.NoError(t, w.Release(ctx))
	})
}

// TestSharedNoUpgrade: no upgrade in place: a shared holder's exclusive
// attempt is refused like anyone's (the key is held shared, by itself
// too), and granted once its shared Guard is released.
func TestSharedNoUpgrade(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		c := newPermitClient(t, memory.New(), sqllock.Options{})
		ctx := t.Context()
		r, err := c.Acquire(ctx, "cfg", shared)
		require.NoError(t, err)
		_, err = c.TryAcquire(ctx, "cfg", nil)
		var he *sqllock.HeldError
		require.ErrorAs(t, err, &he)
		require.Equal(t, 1, he.Shared)
		require.NoError(t, r.Release(ctx))
		w, err := c.TryAcquire(ctx, "cfg", nil)
		require.NoError(t, err)
		require.Greater(t, w.Token(), r.Token())
		require.NoError(t, w.Release(ctx))
	})
}

// TestSharedBadOptions: the combinations that cannot work are refused
// before any I/O.
func TestSharedBadOptions(t *testing.T) {
	t.Parallel()
	b := memory.New()
	c := newPermitClient(t, b, sqllock.Options{})
	ctx := t.Context()
	_, err := c.Acquire(ctx, "k", &sqllock.AcquireOptions{Shared: true, MinHold: time.Second})
	require.ErrorIs(t, err, sqllock.ErrMinHoldUnsupported)
	_, err = c.AcquirePermit(ctx, "k", 2, shared)
	require.ErrorIs(t, err, sqllock.ErrInvalidOption)
	_, err = c.AcquireAll(ctx, []string{"k"}, shared)
	require.ErrorIs(t, err, sqllock.ErrInvalidOption)
	all, err := b.List(ctx, "")
	require.NoError(t, err)
	require.Empty(t, all)
}

// exclusiveOnly is a backend that grants no shared requests: as a backend
// that knows nothing of them, it validates with AcquireRequest.Validate.
type exclusiveOnly struct{ *memory.Backend }

func (e exclusiveOnly) TryAcquire(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	if err := req.Validate(); err != nil {
		return sqllock.Lease{}, err
	}
	return e.Backend.TryAcquire(ctx, req)
}

// TestSharedUnsupported: a backend without shared grants refuses a shared
// acquire, waiting or not, with ErrSharedUnsupported, and nothing is
// written.
func TestSharedUnsupported(t *testing.T) {
	t.Parallel()
	b := exclusiveOnly{memory.New()}
	c := newPermitClient(t, b, sqllock.Options{})
	for _, o := range []*sqllock.AcquireOptions{shared, {Shared: true, Wait: time.Hour}} {
		_, err := c.Acquire(t.Context(), "k", o)
		require.ErrorIs(t, err, sqllock.ErrSharedUnsupported)
	}
	all, err := b.List(t.Context(), "")
	require.NoError(t, err)
	require.Empty(t, all)
}

// TestSharedLossReported: a forced release of a key held shared ends its
// shared Guards at their next renewal, with LostReleased.
func TestSharedLossReported(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b := memory.New()
		c := newPermitClient(t, b, sqllock.Options{TTL: 3 * time.Second})
		ctx := t.Context()
		r, err := c.Acquire(ctx, "cfg", shared)
		require.NoError(t, err)
		all, err := b.List(ctx, "cfg")
		require.NoError(t, err)
		var tok int64
		for _, i := range all {
			if i.Key == "cfg" {
				tok = i.Token
			}
		}
		_ = b.Release(ctx, sqllock.Lease{Key: "cfg", Token: tok, Owner: "admin"})
		select {
		case <-r.Done():
		case <-time.After(3 * time.Second):
			t.Fatal("the shared Guard outlived its key's forced release past its TTL")
		}
		var le *sqllock.LostError
		require.ErrorAs(t, context.Cause(r.Context()), &le)
		require.Equal(t, sqllock.LostReleased, le.Reason)
	})
}

// TestWaitingWriterNotStarved: readers keep arriving, each holding for a
// while, so that the key is never free of readers; a waiting writer is
// granted within the readers' TTL plus a poll, because its mark keeps new
// readers out, and the readers that keep trying get in again after it.
func TestWaitingWriterNotStarved(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b := memory.New()
		const ttl = 2 * time.Second
		c := newPermitClient(t, b, sqllock.Options{TTL: ttl})
		ctx, cancel := context.WithCancel(t.Context())
		var wg sync.WaitGroup
		var after sync.WaitGroup // reader grants after the writer's
		writerDone := make(chan struct{})
		for i := range 4 {
			wg.Go(func() {
				time.Sleep(time.Duration(i) * 100 * time.Millisecond)
				seenAfter := false
				for ctx.Err() == nil {
					// Each reader holds 400ms, so at every instant some
					// reader holds the key.
					g, err := c.Acquire(ctx, "cfg", &sqllock.AcquireOptions{Shared: true, Wait: sqllock.WaitForever})
					if err != nil {
						return
					}
					select {
					case <-writerDone:
						if !seenAfter {
							seenAfter = true
							after.Done()
						}
					default:
					}
					time.Sleep(400 * time.Millisecond)
					_ = g.Release(context.Background())
				}
			})
			after.Add(1)
		}
		time.Sleep(time.Second) // the readers are under way
		start := time.Now()
		w, err := c.Acquire(ctx, "cfg", &sqllock.AcquireOptions{Wait: 5 * ttl})
		waited := time.Since(start)
		if err != nil {
			cancel()
			wg.Wait()
			t.Fatalf("the writer starved for %v: %v", waited, err)
		}
		require.LessOrEqual(t, waited, ttl+300*time.Millisecond, "the writer waited %v", waited)
		time.Sleep(100 * time.Millisecond)
		require.NoError(t, w.Release(ctx))
		close(writerDone)
		after.Wait() // every reader got in again after the writer
		cancel()
		wg.Wait()
	})
}
