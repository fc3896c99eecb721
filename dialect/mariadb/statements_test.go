package mariadb

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// info is key's row as List reports it.
func info(t *testing.T, b *Backend, key string) sqllock.LockInfo {
	t.Helper()
	is, err := b.List(testCtx(t), key)
	require.NoError(t, err)
	require.Len(t, is, 1)
	return is[0]
}

// A stale holder's renewal changes nothing of the newer holder's row: its
// deadline stays as the newer holder's own grant set it, in both forms.
func TestStaleRenewChangesNothing(t *testing.T) {
	b, db := newBackend(t)
	old, err := b.TryAcquire(testCtx(t), acq("k"))
	require.NoError(t, err)
	expire(t, db, b, "k")
	newer, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o2"})
	require.NoError(t, err)
	before := info(t, b, "k")

	_, err = b.TryRenew(testCtx(t), old, time.Hour)
	require.ErrorIs(t, err, sqllock.ErrLeaseLost)
	require.Equal(t, before.Deadline, info(t, b, "k").Deadline, "a stale renewal moved the newer holder's deadline")

	res, err := b.TryRenewBatch(testCtx(t), []sqllock.RenewRequest{{Lease: old, TTL: time.Hour}})
	require.NoError(t, err)
	require.ErrorIs(t, res[0].Err, sqllock.ErrLeaseLost)
	require.Equal(t, before.Deadline, info(t, b, "k").Deadline, "a stale batch renewal moved the newer holder's deadline")
	require.Equal(t, newer.Token, info(t, b, "k").Token)
}

// A holder's release inside its min hold keeps the key until the hold's
// end, not until the (later) deadline of its TTL: a TTL longer than the
// hold does not stretch the hold.
// Both release statements: the common one, and releaseSQL alone.
func TestReleaseInsideMinHoldEndsAtTheHold(t *testing.T) {
	for _, rowRelease := range []bool{false, true} {
		t.Run(map[bool]string{false: "Held", true: "Row"}[rowRelease], func(t *testing.T) {
			b, _ := newBackend(t)
			b.rowRelease = rowRelease
			releaseInsideMinHold(t, b)
		})
	}
}

func releaseInsideMinHold(t *testing.T, b *Backend) {
	const hold = 300 * time.Millisecond
	l, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o1", MinHold: hold})
	require.NoError(t, err)
	require.NoError(t, b.Release(testCtx(t), l))
	i := info(t, b, "k")
	require.True(t, i.Held, "held inside the min hold")
	end := l.BackendTime.Add(hold)
	require.False(t, i.Deadline.Before(end), "deadline %v before the hold's end %v", i.Deadline, end)
	require.False(t, i.Deadline.After(end.Add(time.Millisecond)), "deadline %v: the release kept the TTL's deadline, not the hold's end %v", i.Deadline, end)
	time.Sleep(2 * hold)
	next, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o2"})
	require.NoError(t, err, "free once the hold ended")
	require.Equal(t, l.Token+1, next.Token)
}

// A new tenure of the same owner (its acquire repeated after its own lease
// expired) holds the key for its own min hold, counted from its own grant,
// not for the hold of the tenure before.
func TestNewTenureOfTheSameOwnerHasItsOwnMinHold(t *testing.T) {
	b, db := newBackend(t)
	req := sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o1", MinHold: time.Hour}
	first, err := b.TryAcquire(testCtx(t), req)
	require.NoError(t, err)
	time.Sleep(10 * time.Millisecond)
	expire(t, db, b, "k")
	second, err := b.TryAcquire(testCtx(t), req)
	require.NoError(t, err)
	require.Equal(t, first.Token+1, second.Token, "a new tenure")
	require.NoError(t, b.Release(testCtx(t), second))
	i := info(t, b, "k")
	require.True(t, i.Held, "held inside the second tenure's min hold")
	require.False(t, i.Deadline.Before(second.BackendTime.Add(time.Hour)),
		"deadline %v: the release kept the first tenure's hold (%v), not the second's (%v)",
		i.Deadline, first.BackendTime.Add(time.Hour), second.BackendTime.Add(time.Hour))
}
