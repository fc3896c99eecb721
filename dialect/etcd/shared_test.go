package etcd

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// TestSharedMarkBetweenReadAndTxn lets a waiting writer mark the key
// between a reader's read (no mark yet) and its grant transaction: the
// transaction compares the mark absent, so the reader is refused, naming
// the writer, and is not let past the mark.
func TestSharedMarkBetweenReadAndTxn(t *testing.T) {
	t.Parallel()
	tb := newBundle(t)
	a, other := tb.backend, sameEtcd(t, tb)
	ctx := testCtx(t)
	r0, err := other.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: 10 * time.Second, Owner: "r0", Shared: true})
	require.NoError(t, err)
	landed := false
	a.beforeGrant = func(key string) {
		if landed {
			return
		}
		landed = true
		_, err := other.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: 10 * time.Second, Owner: "w", Mark: true})
		require.ErrorIs(t, err, sqllock.ErrNotAcquired, "the writer waits for r0")
	}
	l, err := a.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: 10 * time.Second, Owner: "r1", Shared: true})
	require.True(t, landed)
	var he *sqllock.HeldError
	require.True(t, errors.As(err, &he), "a reader past a live mark: granted %+v, %v", l, err)
	require.Equal(t, "w", he.WaitingWriter)
	require.Equal(t, 1, he.Shared)
	require.NoError(t, other.Release(ctx, r0))
	w, err := other.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: 10 * time.Second, Owner: "w", Mark: true})
	require.NoError(t, err)
	require.Greater(t, w.Token, r0.Token)
}

// TestSetRefusedBesideReaders: a set of keys, one of them read, is
// refused whole: the set's grant compares each key free of readers, as a
// single exclusive grant does.
func TestSetRefusedBesideReaders(t *testing.T) {
	t.Parallel()
	b := newBundle(t).backend
	ctx := testCtx(t)
	r, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "b", TTL: 10 * time.Second, Owner: "r", Shared: true})
	require.NoError(t, err)
	for range 2 { // the second with this Backend's hints of both keys
		_, err = b.TryAcquireAll(ctx, sqllock.MultiAcquireRequest{Keys: []string{"a", "b"}, TTL: 10 * time.Second, Owner: "set"})
		require.ErrorIs(t, err, sqllock.ErrNotAcquired, "a set granted beside a reader of one of its keys")
	}
	require.NoError(t, b.Release(ctx, r))
	_, err = b.TryAcquireAll(ctx, sqllock.MultiAcquireRequest{Keys: []string{"a", "b"}, TTL: 10 * time.Second, Owner: "set"})
	require.NoError(t, err)
}
