package etcd

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ashlock/ashlock/sqllock"
)

// loseReply makes the next n calls of method lose their reply after the
// server applied them; cancel, if not nil, runs first (the caller's
// context ends while the request is in flight).
func loseReply(b *Backend, calls interface {
	SetFail(func(string, error) error)
}, method string, n int, cancel func()) {
	var left atomic.Int32
	left.Store(int32(n))
	calls.SetFail(func(m string, err error) error {
		if err != nil || m != method || left.Add(-1) < 0 {
			return err
		}
		if cancel != nil {
			cancel()
			return status.Error(codes.Canceled, "context canceled (injected after the server applied the request)")
		}
		// The etcd client repeats a lease grant that failed with
		// Unavailable, and any call that failed with DeadlineExceeded while
		// its context lives (harmless here: every transaction of the
		// backend compares, so a repeat of an applied one changes
		// nothing), so the fault would not show with those.
		code := codes.Unavailable
		if m == "LeaseGrant" {
			code = codes.Internal
		}
		return status.Error(code, "reply lost (injected after the server applied the request)")
	})
}

// TestIndeterminateSettledByRepeating: a grant or a release whose reply is
// lost is reported as ErrIndeterminate, never guessed, and repeating the
// same request settles it: the same grant (one tenure), or nil.
func TestIndeterminateSettledByRepeating(t *testing.T) {
	t.Parallel()
	for _, how := range []string{"connection", "context"} {
		t.Run(how, func(t *testing.T) {
			t.Parallel()
			b, calls, other := counted(t)
			ctx := testCtx(t)
			req := sqllock.AcquireRequest{Key: "k", TTL: 10 * time.Second, Owner: "o1"}
			octx, cancel := context.WithCancel(ctx)
			defer cancel()
			if how == "connection" {
				cancel = nil
			}
			loseReply(b, calls, "Txn", 1, cancel)
			_, err := b.TryAcquire(octx, req)
			require.ErrorIs(t, err, sqllock.ErrIndeterminate)
			calls.SetFail(nil)
			// It was applied: another owner is refused, the repeat gets it.
			_, err = other.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: 10 * time.Second, Owner: "o2"})
			require.ErrorIs(t, err, sqllock.ErrNotAcquired)
			l, err := b.TryAcquire(ctx, req)
			require.NoError(t, err)
			require.Equal(t, int64(1), l.Token, "the repeat returns the grant it settles, not a second tenure")
			all, err := b.List(ctx, "k")
			require.NoError(t, err)
			require.Len(t, all, 1)
			require.Equal(t, int64(1), all[0].Token)

			octx, cancel = context.WithCancel(ctx)
			defer cancel()
			if how == "connection" {
				cancel = nil
			}
			loseReply(b, calls, "Txn", 1, cancel)
			require.ErrorIs(t, b.Release(octx, l), sqllock.ErrIndeterminate)
			calls.SetFail(nil)
			require.NoError(t, b.Release(ctx, l), "the repeat of an applied release")
			all, err = b.List(ctx, "k")
			require.NoError(t, err)
			require.False(t, all[0].Held)
		})
	}
}

// TestIndeterminateGrantNotApplied: a lost lease grant changes no lock and
// is merely unavailable; a lost reply of a renewal is too (a renew keeps
// the token, so repeating it is safe).
func TestIndeterminateGrantNotApplied(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	req := sqllock.AcquireRequest{Key: "k", TTL: 10 * time.Second, Owner: "o1"}
	loseReply(b, calls, "LeaseGrant", 1, nil)
	_, err := b.TryAcquire(ctx, req)
	require.ErrorIs(t, err, sqllock.ErrUnavailable)
	require.NotErrorIs(t, err, sqllock.ErrIndeterminate)
	calls.SetFail(nil)
	l, err := b.TryAcquire(ctx, req)
	require.NoError(t, err)
	loseReply(b, calls, "Txn", 1, nil)
	_, err = b.TryRenew(ctx, l, 10*time.Second)
	require.ErrorIs(t, err, sqllock.ErrUnavailable)
	require.NotErrorIs(t, err, sqllock.ErrIndeterminate)
	calls.SetFail(nil)
	_, err = b.TryRenew(ctx, l, 10*time.Second)
	require.NoError(t, err)
}

// TestClientSettlesIndeterminateAcquire: through sqllock.Client, an
// acquire whose reply is lost is settled by the client's repeat into one
// guard with the token granted.
func TestClientSettlesIndeterminateAcquire(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	c, err := sqllock.New(b, sqllock.Options{})
	require.NoError(t, err)
	defer c.Close(ctx)
	loseReply(b, calls, "Txn", 1, nil)
	g, err := c.TryAcquire(ctx, "k", &sqllock.AcquireOptions{TTL: 10 * time.Second})
	require.NoError(t, err)
	require.Equal(t, int64(1), g.Token())
	require.NoError(t, g.Release(ctx))
	all, err := b.List(ctx, "")
	require.NoError(t, err)
	require.Len(t, all, 1)
	require.Equal(t, int64(1), all[0].Token, "one tenure")
	require.False(t, all[0].Held)
}
