package etcd

import (
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

func setReq(owner string, keys ...string) sqllock.MultiAcquireRequest {
	return sqllock.MultiAcquireRequest{Keys: keys, TTL: 10 * time.Second, Owner: owner}
}

func setKeys(prefix string, n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("%s%02d", prefix, i)
	}
	return keys
}

// TestSetRoundTrips: a set is one transaction (and an etcd lease per key,
// as a single acquire's), granted or refused; a refusal asks the refusing
// holder's time-to-live and writes nothing.
func TestSetRoundTrips(t *testing.T) {
	t.Parallel()
	b, calls, other := counted(t)
	ctx := testCtx(t)
	calls.Take()
	ls, err := b.TryAcquireAll(ctx, setReq("o1", "d", "a", "c", "b"))
	require.NoError(t, err)
	_, by := calls.Take()
	require.Equal(t, "LeaseGrant×4 Txn×1", by)
	for i, k := range []string{"d", "a", "c", "b"} {
		require.Equal(t, k, ls[i].Key, "leases in the request's order")
		require.Equal(t, int64(1), ls[i].Token)
	}
	require.Len(t, slices.CompactFunc(slices.Clone(ls), func(x, y sqllock.Lease) bool { return x.BackendTime == y.BackendTime }), 4,
		"each key on an etcd lease of its own")
	_, err = other.TryAcquire(ctx, sqllock.AcquireRequest{Key: "f", TTL: 10 * time.Second, Owner: "x"})
	require.NoError(t, err)
	calls.Take()
	_, err = b.TryAcquireAll(ctx, setReq("o2", "g", "f", "e"))
	var he *sqllock.HeldError
	require.True(t, errors.As(err, &he), "%v", err)
	require.Equal(t, "f", he.Key)
	require.Equal(t, "x", he.Owner)
	_, by = calls.Take()
	require.Equal(t, "LeaseGrant×3 LeaseTimeToLive×1 Txn×1", by)
	all, err := b.List(ctx, "")
	require.NoError(t, err)
	for _, i := range all {
		require.NotContains(t, []string{"e", "g"}, i.Key, "a refused set wrote its fresh key")
	}
}

// TestSetWithinMaxTxnOps: a set's compares count against etcd's
// --max-txn-ops (128 by default): the largest set that fits is granted,
// one key more is refused before any I/O, as is a set over a lower
// Options.MaxTxnOps.
func TestSetWithinMaxTxnOps(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	n := b.maxSetKeys()
	require.Equal(t, 42, n)
	ls, err := b.TryAcquireAll(ctx, setReq("o", setKeys("k", n)...))
	require.NoError(t, err, "a set of %d keys", n)
	require.Len(t, ls, n)
	calls.Take()
	_, err = b.TryAcquireAll(ctx, setReq("o", setKeys("m", n+1)...))
	require.ErrorIs(t, err, sqllock.ErrInvalidKey)
	require.Contains(t, err.Error(), "MaxTxnOps")
	total, by := calls.Take()
	require.Zero(t, total, "refused before any I/O, but %s", by)

	small, err := New(b.cli, Options{Prefix: b.Prefix(), MaxTxnOps: 9})
	require.NoError(t, err)
	_, err = small.TryAcquireAll(ctx, setReq("o", setKeys("s", 4)...))
	require.ErrorIs(t, err, sqllock.ErrInvalidKey)
	_, err = small.TryAcquireAll(ctx, setReq("o", setKeys("s", 3)...))
	require.NoError(t, err)
}

// TestSetRetryAfterLostReply: a set whose reply was lost is indeterminate;
// its repeat by the same owner gets the same tokens (one tenure a key),
// and no other owner can take a key of it meanwhile.
func TestSetRetryAfterLostReply(t *testing.T) {
	t.Parallel()
	b, calls, other := counted(t)
	ctx := testCtx(t)
	keys := []string{"x", "y", "z"}
	first, err := b.TryAcquireAll(ctx, setReq("o0", keys...))
	require.NoError(t, err)
	for _, l := range first {
		require.NoError(t, b.Release(ctx, l))
	}
	loseReply(b, calls, "Txn", 1, nil)
	_, err = b.TryAcquireAll(ctx, setReq("o1", keys...))
	require.ErrorIs(t, err, sqllock.ErrIndeterminate)
	calls.SetFail(nil)
	_, err = other.TryAcquire(ctx, sqllock.AcquireRequest{Key: "y", TTL: 10 * time.Second, Owner: "o2"})
	require.ErrorIs(t, err, sqllock.ErrNotAcquired, "the lost reply's set was applied")
	again, err := b.TryAcquireAll(ctx, setReq("o1", "z", "y", "x"))
	require.NoError(t, err)
	for i, l := range again {
		require.Equal(t, first[2-i].Token+1, l.Token, "%s: the grant the lost reply carried, not a second tenure", l.Key)
		require.Equal(t, 10*time.Second, l.Deadline.Sub(l.BackendTime))
		r, err := b.TryRenew(ctx, l, 10*time.Second)
		require.NoError(t, err, "%s: the repeat's lease renews", l.Key)
		require.Equal(t, l.Token, r.Token)
	}
}

// TestSetMembersExpireAlone: each key of a set is on an etcd lease of its
// own, so a member that expires is lost alone (its Guard ends; the
// GuardSet's context with it), and the others stay held and renew.
func TestSetMembersExpireAlone(t *testing.T) {
	t.Parallel()
	b := newBundle(t).backend
	ctx := testCtx(t)
	ls, err := b.TryAcquireAll(ctx, setReq("o", "a", "b"))
	require.NoError(t, err)
	expire(t, b, "a")
	_, err = b.TryRenew(ctx, ls[0], 10*time.Second)
	var lost *sqllock.LostError
	require.True(t, errors.As(err, &lost), "%v", err)
	require.Equal(t, sqllock.LostExpired, lost.Reason)
	_, err = b.TryRenew(ctx, ls[1], 10*time.Second)
	require.NoError(t, err, "the other member is untouched")
	l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "a", TTL: 10 * time.Second, Owner: "next"})
	require.NoError(t, err)
	require.Equal(t, ls[0].Token+1, l.Token)
}

// TestSetsOverlapAcrossBackends: Backends of their own (processes, as far
// as etcd can tell) take overlapping sets in opposite orders over and
// over: every call ends (an etcd transaction never waits), and no key is
// granted while another set holds it.
func TestSetsOverlapAcrossBackends(t *testing.T) {
	t.Parallel()
	first := newBundle(t).backend
	ctx := testCtx(t)
	var mu sync.Mutex
	holder := map[string]string{}
	grants := 0
	var wg sync.WaitGroup
	for w := range 4 {
		b, err := New(first.cli, Options{Prefix: first.Prefix()})
		require.NoError(t, err)
		keys := []string{"p", "q", "r"}
		if w%2 == 1 {
			slices.Reverse(keys)
		}
		wg.Go(func() {
			for r := range 15 {
				owner := fmt.Sprintf("w%d-%d", w, r)
				ls, err := b.TryAcquireAll(ctx, setReq(owner, keys[:2+r%2]...))
				if errors.Is(err, sqllock.ErrNotAcquired) {
					continue
				}
				if err != nil {
					t.Error(err)
					return
				}
				mu.Lock()
				grants++
				for _, l := range ls {
					if o, ok := holder[l.Key]; ok {
						t.Errorf("%s granted %s while %s holds it", owner, l.Key, o)
					}
					holder[l.Key] = owner
				}
				mu.Unlock()
				mu.Lock()
				for _, l := range ls {
					delete(holder, l.Key)
				}
				mu.Unlock()
				for _, l := range ls {
					if err := b.Release(ctx, l); err != nil {
						t.Error(err)
					}
				}
			}
		})
	}
	wg.Wait()
	require.Positive(t, grants)
}

// TestClientSettlesIndeterminateSet: through sqllock.Client, a set whose
// reply is lost is settled by the client's repeat into one GuardSet with
// the tokens granted, released together.
func TestClientSettlesIndeterminateSet(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	c, err := sqllock.New(b, sqllock.Options{})
	require.NoError(t, err)
	defer c.Close(ctx)
	loseReply(b, calls, "Txn", 1, nil)
	set, err := c.AcquireAll(ctx, []string{"b", "a", "c"}, &sqllock.AcquireOptions{TTL: 10 * time.Second})
	require.NoError(t, err)
	for _, k := range []string{"a", "b", "c"} {
		require.Equal(t, int64(1), set.Guard(k).Token(), "%s: one tenure", k)
	}
	require.NoError(t, set.Release(ctx))
	all, err := b.List(ctx, "")
	require.NoError(t, err)
	require.Len(t, all, 3)
	for _, i := range all {
		require.False(t, i.Held, "%s", i.Key)
		require.Equal(t, int64(1), i.Token, "%s", i.Key)
	}
}
