package sqllock_test

import (
	"context"
	"errors"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// TestMaxHoldEndsGuard: a Guard with a MaxHold ends at the acquire's send
// time + MaxHold, to the nanosecond, with reason LostMaxHold (also in the
// Observer's Lost event); the renewal that brings the local deadline to
// the cap is the last one sent.
func TestMaxHoldEndsGuard(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const maxHold = 5*time.Second + 500*time.Millisecond
		var r recorder
		tb := setup(t, sqllock.Options{Observer: r.observer()})
		start := time.Now()
		g, err := tb.client.TryAcquire(t.Context(), "k", &sqllock.AcquireOptions{MaxHold: maxHold})
		require.NoError(t, err)
		require.Equal(t, start.Add(maxHold), g.MaxHoldDeadline())
		select {
		case <-g.Done():
		case <-time.After(10 * maxHold):
			t.Fatal("not stopped at the max hold")
		}
		require.Equal(t, start.Add(maxHold), time.Now(), "ended at acquire + MaxHold")
		require.Equal(t, sqllock.LostMaxHold, lostReason(t, g))
		// The lease is still held at the backend (its own deadline, 3s +
		// TTL, ends it): the client does not release it on its own.
		require.True(t, held(t, tb.mem, "k"))
		time.Sleep(10 * ttl)
		// Renewed at 1s, 2s and 3s: the third brought the local deadline
		// (3s + TTL - margin) past the cap, so none followed.
		renews := tb.b.renewTimes()
		require.Len(t, renews, 3)
		for i, at := range renews {
			require.Equal(t, time.Duration(i+1)*interval, at.Sub(start), "renew %d", i)
		}
		lost := of[sqllock.LostEvent](&r)
		require.Len(t, lost, 1)
		require.Equal(t, sqllock.LostMaxHold, lost[0].Reason)
		require.Equal(t, "max_hold", lost[0].Reason.Name())
		require.Equal(t, maxHold, lost[0].Held)
		err = g.Release(t.Context())
		var le *sqllock.LostError
		require.ErrorAs(t, err, &le)
		require.Equal(t, sqllock.LostMaxHold, le.Reason)
		require.False(t, held(t, tb.mem, "k"))
	})
}

// TestMaxHoldBeforeFirstRenewal: a MaxHold shorter than the first local
// deadline sends no renewal at all.
func TestMaxHoldBeforeFirstRenewal(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const maxHold = 1500 * time.Millisecond // after the first renewal would be due
		tb := setup(t, sqllock.Options{})
		start := time.Now()
		g, err := tb.client.Acquire(t.Context(), "k", &sqllock.AcquireOptions{MaxHold: maxHold})
		require.NoError(t, err)
		require.Equal(t, start.Add(maxHold), g.LocalDeadline(), "the local deadline is capped")
		select {
		case <-g.Done():
		case <-time.After(10 * maxHold):
			t.Fatal("not stopped at the max hold")
		}
		require.Equal(t, start.Add(maxHold), time.Now())
		require.Equal(t, sqllock.LostMaxHold, lostReason(t, g))
		time.Sleep(2 * ttl)
		require.Zero(t, tb.b.n("renew"), "no renewal can extend a capped deadline")
		require.ErrorIs(t, g.Release(t.Context()), sqllock.ErrLeaseLost)
	})
}

// TestMaxHoldDo: Do returns the max-hold loss of a job that hangs until
// its context ends, at acquire + MaxHold, and releases the key.
func TestMaxHoldDo(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		const maxHold = 4 * time.Second
		tb := setup(t, sqllock.Options{})
		start := time.Now()
		err := tb.client.Do(t.Context(), "k", &sqllock.AcquireOptions{MaxHold: maxHold}, func(ctx context.Context, _ *sqllock.Guard) error {
			select {
			case <-ctx.Done():
			case <-time.After(10 * maxHold):
				return errors.New("not stopped at the max hold")
			}
			require.Equal(t, start.Add(maxHold), time.Now())
			return context.Cause(ctx)
		})
		require.ErrorIs(t, err, sqllock.ErrLeaseLost)
		var le *sqllock.LostError
		require.ErrorAs(t, err, &le)
		require.Equal(t, sqllock.LostMaxHold, le.Reason)
		require.Equal(t, `sqllock: lease lost: "k" token 1 held for its maximum hold`, le.Error())
		require.False(t, held(t, tb.mem, "k"), "Do released it")
		for _, at := range tb.b.renewTimes() {
			require.Less(t, at.Sub(start), maxHold, "no renewal after the max hold")
		}
	})
}

// TestMaxHoldUnreachableFirst: renewals that fail end the Guard at its
// own local deadline, before the cap, as unreachable, not max_hold.
func TestMaxHoldUnreachableFirst(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		tb := setup(t, sqllock.Options{})
		tb.b.renew = func(context.Context, sqllock.Lease, time.Duration) (sqllock.Lease, error) {
			return sqllock.Lease{}, sqllock.ErrUnavailable
		}
		g, err := tb.client.TryAcquire(t.Context(), "k", &sqllock.AcquireOptions{MaxHold: 2 * ttl})
		require.NoError(t, err)
		local := g.LocalDeadline()
		<-g.Done()
		require.Equal(t, local, time.Now())
		require.Equal(t, sqllock.LostUnreachable, lostReason(t, g))
		_ = g.Release(t.Context())
	})
}

// TestMaxHoldRefused: a negative MaxHold, or one below MinInterval, is
// refused before any I/O by every acquire.
func TestMaxHoldRefused(t *testing.T) {
	t.Parallel()
	tb := setup(t, sqllock.Options{})
	for _, d := range []time.Duration{-time.Second, 1, sqllock.MinInterval - 1} {
		ao := &sqllock.AcquireOptions{MaxHold: d}
		_, err1 := tb.client.TryAcquire(t.Context(), "k", ao)
		_, err2 := tb.client.Acquire(t.Context(), "k", ao)
		err3 := tb.client.Do(t.Context(), "k", ao, func(context.Context, *sqllock.Guard) error { return nil })
		for _, err := range []error{err1, err2, err3} {
			require.ErrorIs(t, err, sqllock.ErrInvalidOption, "%v", d)
			var oe *sqllock.OptionError
			require.True(t, errors.As(err, &oe), "%v", d)
			require.Equal(t, "AcquireOptions.MaxHold", oe.Field)
			require.Equal(t, d, oe.Value)
			require.Equal(t, sqllock.MinInterval, oe.Min)
		}
	}
	require.Zero(t, tb.b.n("acquire"), "refused before any I/O")
	g, err := tb.client.TryAcquire(t.Context(), "k", &sqllock.AcquireOptions{MaxHold: sqllock.MinInterval})
	require.NoError(t, err, "MinInterval is accepted")
	_ = g.Release(t.Context())
	g, err = tb.client.TryAcquire(t.Context(), "k", nil)
	require.NoError(t, err)
	require.True(t, g.MaxHoldDeadline().IsZero(), "no max hold")
	_ = g.Release(t.Context())
}
