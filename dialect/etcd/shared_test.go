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
