package sqllock_test

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// releasing is the memory backend with a set's acquire, its batch renewal
// and its release of a set observable and replaceable.
type releasing struct {
	*multiBackend

	mu      sync.Mutex
	all     func(ctx context.Context, ls []sqllock.Lease) ([]error, error) // nil: the memory backend's
	sets    [][]string                                                     // the keys of each ReleaseAll
	singles []string                                                       // the key of each Release
}

func (b *releasing) ReleaseAll(ctx context.Context, ls []sqllock.Lease) ([]error, error) {
	keys := make([]string, len(ls))
	for i, l := range ls {
		keys[i] = l.Key
	}
	b.mu.Lock()
	b.sets = append(b.sets, keys)
	f := b.all
	b.mu.Unlock()
	if f != nil {
		return f(ctx, ls)
	}
	return b.mem.ReleaseAll(ctx, ls)
}

func (b *releasing) Release(ctx context.Context, l sqllock.Lease) error {
	b.mu.Lock()
	b.singles = append(b.singles, l.Key)
	b.mu.Unlock()
	return b.mem.Release(ctx, l)
}

func (b *releasing) calls() (sets [][]string, singles []string) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return slices.Clone(b.sets), slices.Clone(b.singles)
}

func setupReleasing(t *testing.T) (*releasing, *sqllock.Client) {
	t.Helper()
	mb, _ := setupMulti(t, sqllock.Options{})
	b := &releasing{multiBackend: mb}
	c, err := sqllock.New(b, sqllock.Options{TTL: ttl, Owner: "test", Backoff: func(int) time.Duration { return time.Millisecond }})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	return b, c
}

// A set is released in one call of the backend's ReleaseAll, not one
// Release per key, and every key is free after it.
func TestGuardSetReleaseIsOneCall(t *testing.T) {
	t.Parallel()
	b, c := setupReleasing(t)
	keys := []string{"d", "a", "c", "b"}
	set, err := c.AcquireAll(t.Context(), keys, nil)
	require.NoError(t, err)
	require.NoError(t, set.Release(t.Context()))
	sets, singles := b.calls()
	require.Equal(t, [][]string{keys}, sets)
	require.Empty(t, singles)
	for _, k := range keys {
		_, ok := heldBy(t, b.mem, k)
		require.False(t, ok, "%s held after Release", k)
	}
	require.NoError(t, set.Release(t.Context()), "a second Release reports the same")
	sets, _ = b.calls()
	require.Len(t, sets, 1, "a second Release sends nothing")
}

// A member lost to a forced release is reported as today (its LostError)
// and not sent; the others go in one call.
func TestGuardSetReleaseAllReportsLoss(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		b, c := setupReleasing(t)
		set, err := c.AcquireAll(t.Context(), []string{"a", "b", "c"}, nil)
		require.NoError(t, err)
		forced := set.Guard("b").Lease()
		forced.Owner = "admin"
		require.NoError(t, b.mem.Release(t.Context(), forced))
		<-set.Done()
		err = set.Release(t.Context())
		var le *sqllock.LostError
		require.ErrorAs(t, err, &le)
		require.Equal(t, "b", le.Key)
		require.Equal(t, sqllock.LostReleased, le.Reason)
		sets, singles := b.calls()
		require.Equal(t, [][]string{{"a", "c"}}, sets)
		require.Empty(t, singles)
		require.ErrorIs(t, set.Release(t.Context()), sqllock.ErrLeaseLost, "a second Release reports the same")
	})
}

// A member whose answer is the backend's expired loss reports it, the
// others nil: each member gets its own answer.
func TestGuardSetReleaseAllPerMemberAnswers(t *testing.T) {
	t.Parallel()
	b, c := setupReleasing(t)
	set, err := c.AcquireAll(t.Context(), []string{"a", "b", "c"}, nil)
	require.NoError(t, err)
	b.all = func(ctx context.Context, ls []sqllock.Lease) ([]error, error) {
		out, err := b.mem.ReleaseAll(ctx, ls)
		for i, l := range ls {
			if l.Key == "c" {
				out[i] = &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostExpired}
			}
		}
		return out, err
	}
	err = set.Release(t.Context())
	var le *sqllock.LostError
	require.ErrorAs(t, err, &le)
	require.Equal(t, "c", le.Key)
	require.Equal(t, sqllock.LostExpired, le.Reason)
	require.NoError(t, set.Guard("a").Release(t.Context()))
	require.NoError(t, set.Guard("b").Release(t.Context()))
	require.ErrorIs(t, set.Guard("c").Release(t.Context()), sqllock.ErrLeaseLost)
}

// A transient answer is sent again, as a single Release is: a member's
// own alone, the call's failure for every member in one call again.
func TestGuardSetReleaseAllRetriesTransient(t *testing.T) {
	t.Parallel()
	for _, whole := range []bool{false, true} {
		b, c := setupReleasing(t)
		set, err := c.AcquireAll(t.Context(), []string{"a", "b", "c"}, nil)
		require.NoError(t, err)
		first := true
		b.all = func(ctx context.Context, ls []sqllock.Lease) ([]error, error) {
			if !first {
				return b.mem.ReleaseAll(ctx, ls)
			}
			first = false
			if whole {
				return nil, sqllock.ErrIndeterminate // the reply was lost
			}
			out, err := b.mem.ReleaseAll(ctx, ls[:2])
			return append(out, sqllock.ErrUnavailable), err
		}
		require.NoError(t, set.Release(t.Context()))
		sets, singles := b.calls()
		if whole {
			require.Equal(t, [][]string{{"a", "b", "c"}, {"a", "b", "c"}}, sets)
			require.Empty(t, singles)
		} else {
			require.Equal(t, [][]string{{"a", "b", "c"}}, sets)
			require.Equal(t, []string{"c"}, singles)
		}
		for _, k := range []string{"a", "b", "c"} {
			_, ok := heldBy(t, b.mem, k)
			require.False(t, ok, "%s held after Release", k)
		}
	}
}

// A call that keeps failing reports its error for every member after the
// attempts a single Release makes.
func TestGuardSetReleaseAllGivesUp(t *testing.T) {
	t.Parallel()
	b, c := setupReleasing(t)
	set, err := c.AcquireAll(t.Context(), []string{"a", "b"}, nil)
	require.NoError(t, err)
	b.all = func(context.Context, []sqllock.Lease) ([]error, error) { return nil, sqllock.ErrUnavailable }
	err = set.Release(t.Context())
	require.ErrorIs(t, err, sqllock.ErrUnavailable)
	sets, _ := b.calls()
	require.Len(t, sets, 3)
	for _, g := range set.Guards() {
		require.ErrorIs(t, g.Release(t.Context()), sqllock.ErrUnavailable)
	}
}

// A member released before, by its own Release, is not sent again; it
// reports its own release.
func TestGuardSetReleaseAllAfterMemberRelease(t *testing.T) {
	t.Parallel()
	b, c := setupReleasing(t)
	set, err := c.AcquireAll(t.Context(), []string{"a", "b", "c"}, nil)
	require.NoError(t, err)
	require.NoError(t, set.Guard("b").Release(t.Context()))
	require.NoError(t, set.Release(t.Context()))
	sets, singles := b.calls()
	require.Equal(t, [][]string{{"a", "c"}}, sets)
	require.Equal(t, []string{"b"}, singles)
	require.False(t, errors.Is(set.Err(), sqllock.ErrLeaseLost))
}
