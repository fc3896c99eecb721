package sqllock_test

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

// multiBackend is the memory backend with its acquire of a set and its
// batch renewal observable and replaceable.
type multiBackend struct {
	*batchy
	all  func(ctx context.Context, req sqllock.MultiAcquireRequest) ([]sqllock.Lease, error)
	sets atomic.Int64 // TryAcquireAll calls
}

func (b *multiBackend) TryAcquireAll(ctx context.Context, req sqllock.MultiAcquireRequest) ([]sqllock.Lease, error) {
	b.sets.Add(1)
	if b.all != nil {
		return b.all(ctx, req)
	}
	return b.mem.TryAcquireAll(ctx, req)
}

func (b *multiBackend) Watch(key string) (<-chan struct{}, func()) { return b.mem.Watch(key) }

func setupMulti(t *testing.T, opts sqllock.Options) (*multiBackend, *sqllock.Client) {
	t.Helper()
	mem := memory.New()
	b := &multiBackend{batchy: &batchy{Backend: mem, mem: mem}}
	opts.TTL = ttl
	opts.Owner = "test"
	if opts.Backoff == nil {
		opts.Backoff = func(int) time.Duration { return 100 * time.Millisecond }
	}
	c, err := sqllock.New(b, opts)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return b, c
}

func heldBy(t *testing.T, mem *memory.Backend, key string) (string, bool) {
	t.Helper()
	infos, err := mem.List(context.Background(), key)
	require.NoError(t, err)
	if len(infos) != 1 || !infos[0].Held {
		return "", false
	}
	return infos[0].Owner, true
}

// A backend without the capability is named in the error, and nothing is
// sent; bad sets and options are refused before any I/O.
func TestAcquireAllRefusedBeforeIO(t *testing.T) {
	t.Parallel()
	tb := setup(t, sqllock.Options{BackendName: "plain"})
	_, err := tb.client.AcquireAll(t.Context(), []string{"a", "b"}, nil)
	require.ErrorIs(t, err, sqllock.ErrMultiAcquireUnsupported)
	require.Contains(t, err.Error(), "plain")
	require.Zero(t, tb.b.n("acquire"))

	b, c := setupMulti(t, sqllock.Options{})
	many := make([]string, sqllock.MaxKeysPerAcquire+1)
	for i := range many {
		many[i] = fmt.Sprint("k", i)
	}
	for _, in := range []struct {
		keys []string
		opts *sqllock.AcquireOptions
		want error
	}{
		{nil, nil, sqllock.ErrInvalidKey},
		{[]string{"a", "b", "a"}, nil, sqllock.ErrInvalidKey},
		{many, nil, sqllock.ErrInvalidKey},
		{[]string{"a", "b\x00"}, nil, sqllock.ErrInvalidKey},
		{[]string{"a"}, &sqllock.AcquireOptions{MinHold: time.Second}, sqllock.ErrInvalidOption},
		{[]string{"a"}, &sqllock.AcquireOptions{TTL: time.Nanosecond}, sqllock.ErrInvalidTTL},
	} {
		_, err := c.AcquireAll(t.Context(), in.keys, in.opts)
		require.ErrorIs(t, err, in.want, "%q %+v", in.keys, in.opts)
	}
	require.Zero(t, b.sets.Load(), "bad input reached the backend")
	infos, err := b.mem.List(t.Context(), "")
	require.NoError(t, err)
	require.Empty(t, infos)
}

// No Wait: one attempt. A held key refuses the set, naming the first held
// key in key order; nothing of the set is held after.
func TestAcquireAllOneAttempt(t *testing.T) {
	t.Parallel()
	b, c := setupMulti(t, sqllock.Options{})
	other, err := c.TryAcquire(t.Context(), "m", nil)
	require.NoError(t, err)
	_, err = c.TryAcquire(t.Context(), "z", nil)
	require.NoError(t, err)
	set, err := c.AcquireAll(t.Context(), []string{"z", "a", "m"}, nil)
	require.Nil(t, set)
	var he *sqllock.HeldError
	require.ErrorAs(t, err, &he)
	require.Equal(t, "m", he.Key)
	require.Equal(t, other.Lease().Owner, he.Owner)
	require.EqualValues(t, 1, b.sets.Load())
	_, ok := heldBy(t, b.mem, "a")
	require.False(t, ok)

	set, err = c.AcquireAll(t.Context(), []string{"c", "a", "b"}, nil)
	require.NoError(t, err)
	gs := set.Guards()
	require.Len(t, gs, 3)
	for i, k := range []string{"c", "a", "b"} {
		require.Equal(t, k, gs[i].Key())
		require.Same(t, gs[i], set.Guard(k))
		owner, ok := heldBy(t, b.mem, k)
		require.True(t, ok)
		require.Equal(t, gs[0].Lease().Owner, owner, "one owner for the set")
	}
	require.Nil(t, set.Guard("m"))
	require.NoError(t, set.Err())
}

// A positive Wait waits for the refusing key's release and wakes at it
// (the watch of the key that refused); Wait bounds the wait.
func TestAcquireAllWaits(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b, c := setupMulti(t, sqllock.Options{Backoff: func(int) time.Duration { return time.Hour }})
		holder, err := c.TryAcquire(t.Context(), "b", nil)
		require.NoError(t, err)
		start := time.Now()
		go func() {
			time.Sleep(500 * time.Millisecond)
			_ = holder.Release(context.Background())
		}()
		set, err := c.AcquireAll(t.Context(), []string{"a", "b"}, &sqllock.AcquireOptions{Wait: time.Minute})
		require.NoError(t, err)
		require.Equal(t, 500*time.Millisecond, time.Since(start), "woken by the release of the key that refused")
		require.EqualValues(t, 2, b.sets.Load())

		other, err := c.TryAcquire(t.Context(), "c", nil)
		require.NoError(t, err)
		start = time.Now()
		backstop, stop := context.WithTimeout(t.Context(), time.Hour)
		defer stop()
		_, err = c.AcquireAll(backstop, []string{"c", "d"}, &sqllock.AcquireOptions{Wait: 2 * time.Second})
		require.Equal(t, 2*time.Second, time.Since(start), "AcquireAll must give up when Wait passes")
		require.ErrorIs(t, err, sqllock.ErrNotAcquired)
		require.ErrorIs(t, err, context.DeadlineExceeded)
		require.NoError(t, set.Release(t.Context()))
		require.NoError(t, other.Release(t.Context()))
	})
}

// The members come due together and are renewed in one batch, also after
// a batch that failed as a whole.
func TestAcquireAllRenewedAsOneBatch(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b, c := setupMulti(t, sqllock.Options{})
		keys := []string{"w", "x", "y", "z"}
		set, err := c.AcquireAll(t.Context(), keys, nil)
		require.NoError(t, err)
		var failed atomic.Bool
		b.setBatch(func(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
			if failed.CompareAndSwap(false, true) {
				return nil, sqllock.ErrUnavailable
			}
			return b.mem.TryRenewBatch(ctx, reqs)
		})
		time.Sleep(interval + 150*time.Millisecond) // the failed batch and its retry
		time.Sleep(interval)                        // one more
		batches, singles := b.calls()
		require.Empty(t, singles)
		require.Len(t, batches, 3, "%q", batches)
		for _, bt := range batches {
			require.ElementsMatch(t, keys, bt, "the set's leases renewed in one batch")
		}
		require.NoError(t, set.Err())
		require.NoError(t, set.Release(t.Context()))
	})
}

// Lost together: the set's context ends at the first member's loss, with
// its cause; the other members stay held and renewed until Release, which
// releases them and reports the loss.
func TestAcquireAllLostTogether(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b, c := setupMulti(t, sqllock.Options{})
		set, err := c.AcquireAll(t.Context(), []string{"a", "b", "c"}, nil)
		require.NoError(t, err)
		gb := set.Guard("b")
		forced := gb.Lease()
		forced.Owner = "admin"
		require.NoError(t, b.mem.Release(t.Context(), forced))
		select {
		case <-set.Done():
		case <-time.After(2 * interval): // the next renewal finds the loss
			t.Fatal("the set's context did not end at its member's loss")
		}
		var le *sqllock.LostError
		require.ErrorAs(t, set.Err(), &le)
		require.Equal(t, "b", le.Key)
		require.Equal(t, sqllock.LostReleased, le.Reason)
		require.ErrorIs(t, context.Cause(set.Context()), sqllock.ErrLeaseLost)
		for _, k := range []string{"a", "c"} {
			require.NoError(t, set.Guard(k).Err(), "%s ended with its set", k)
		}
		time.Sleep(2 * ttl) // past the leases' first deadlines: renewed since
		for _, k := range []string{"a", "c"} {
			require.NoError(t, set.Guard(k).Err())
			_, ok := heldBy(t, b.mem, k)
			require.True(t, ok, "%s not held until Release", k)
		}
		err = set.Release(t.Context())
		require.ErrorIs(t, err, sqllock.ErrLeaseLost)
		for _, k := range []string{"a", "b", "c"} {
			_, ok := heldBy(t, b.mem, k)
			require.False(t, ok, "%s held after Release", k)
		}
		require.ErrorIs(t, set.Release(t.Context()), sqllock.ErrLeaseLost, "a second Release reports the same")
	})
}

// A reply lost after the backend applied the set is settled by the same
// request: the same grant, one tenure per key.
func TestAcquireAllIndeterminateSettled(t *testing.T) {
	t.Parallel()
	b, c := setupMulti(t, sqllock.Options{})
	var lost atomic.Bool
	b.all = func(ctx context.Context, req sqllock.MultiAcquireRequest) ([]sqllock.Lease, error) {
		ls, err := b.mem.TryAcquireAll(ctx, req)
		if err == nil && lost.CompareAndSwap(false, true) {
			return nil, sqllock.ErrIndeterminate
		}
		return ls, err
	}
	set, err := c.AcquireAll(t.Context(), []string{"a", "b"}, nil)
	require.NoError(t, err)
	require.EqualValues(t, 2, b.sets.Load())
	for _, g := range set.Guards() {
		require.EqualValues(t, 1, g.Token(), "%s: a second tenure", g.Key())
	}
	require.NoError(t, set.Release(t.Context()))
}

// Close releases the members of a set like any Guard.
func TestAcquireAllClose(t *testing.T) {
	t.Parallel()
	b, c := setupMulti(t, sqllock.Options{})
	set, err := c.AcquireAll(t.Context(), []string{"a", "b"}, nil)
	require.NoError(t, err)
	require.NoError(t, c.Close(t.Context()))
	require.ErrorIs(t, set.Err(), sqllock.ErrReleased)
	for _, k := range []string{"a", "b"} {
		_, ok := heldBy(t, b.mem, k)
		require.False(t, ok)
	}
	_, err = c.AcquireAll(t.Context(), []string{"a"}, nil)
	require.ErrorIs(t, err, sqllock.ErrClosed)
}
