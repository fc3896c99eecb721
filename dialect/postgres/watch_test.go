package postgres

import (
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// wakeWithin waits for a wake-up on ch and returns how long it took.
func wakeWithin(t *testing.T, ch <-chan struct{}, limit time.Duration, what string) time.Duration {
	t.Helper()
	start := time.Now()
	select {
	case <-ch:
		return time.Since(start)
	case <-time.After(limit):
		t.Fatalf("no wake-up within %v: %s", limit, what)
		return 0
	}
}

func noWake(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
		t.Fatalf("unexpected wake-up: %s", what)
	default:
	}
}

// listening waits for the first watcher's wake-up from the listener's first
// LISTEN, then drains the others': whether a watcher added after the first
// got that wake-up depends on when it was added (one added once the
// listener listens needs none), so later checks must not see it.
func listening(t *testing.T, b *Backend, first <-chan struct{}, others ...<-chan struct{}) {
	t.Helper()
	wakeWithin(t, first, 10*time.Second, "the listener's first LISTEN wakes the watchers added before it")
	// The wake-ups go out one by one, in map order: wait for the last (the
	// listener publishes its PID once they are out) before draining, or a
	// wake-up could land after the drain.
	require.Eventually(t, func() bool { return b.listener.listeningPID() != 0 },
		10*time.Second, time.Millisecond, "the listener publishes its PID after the wake-ups")
	for _, ch := range others {
		select {
		case <-ch:
		default:
		}
	}
}

// waiting makes the refused acquire attempt of a waiter on b, which
// watches key: like a client's waiting Acquire, it marks the holder's lease
// so that its release notifies (see queries/acquire.sql).
func waiting(t *testing.T, b *Backend, key string) {
	t.Helper()
	require.True(t, b.watched(key), "waiting(%q) without a watch", key)
	_, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: "waiter"})
	var he *sqllock.HeldError
	require.ErrorAs(t, err, &he)
	require.NotEmpty(t, he.Owner, "the waiter's attempt saw the holder")
}

func (l *listener) listeningPID() uint32 {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.pid
}

func TestWatch(t *testing.T) {
	t.Parallel()

	t.Run("ReleaseWakesOnlyThatKey", func(t *testing.T) {
		t.Parallel()
		bundle := newBundle(t, Options{})
		b := bundle.backend
		// A second Backend on the same table, as another process would be.
		other, err := New(bundle.db.Pool, Options{})
		require.NoError(t, err)
		t.Cleanup(func() { other.Close() })

		ch, stop := b.Watch("k")
		defer stop()
		unrelated, stopUnrelated := b.Watch("unrelated")
		defer stopUnrelated()
		listening(t, b, ch, unrelated)

		var lat []time.Duration
		for range 20 {
			l := acquireOK(t, other, "k", "o1", time.Minute)
			waiting(t, b, "k")
			start := time.Now()
			require.NoError(t, other.Release(testCtx(t), l))
			wakeWithin(t, ch, 10*time.Second, "Release by another Backend")
			lat = append(lat, time.Since(start))
		}
		noWake(t, unrelated, "a release of another key")
		t.Logf("release -> wake-up (including the release's round trip): first %v, last %v", lat[0], lat[len(lat)-1])
		// "A release wakes waiters at once" (the README): the median of
		// the 20 is a notification's time, not a poll's (a waiter polls
		// no sooner than every 100 ms, and by default at the holder's
		// deadline); 500 ms leaves room for a loaded host.
		slices.Sort(lat)
		require.Less(t, lat[len(lat)/2], 500*time.Millisecond, "median release -> wake-up")

		// A refused or a stale release notifies nobody.
		l := acquireOK(t, other, "k", "o1", time.Minute)
		waiting(t, b, "k")
		stale := l
		stale.Token--
		require.Error(t, other.Release(testCtx(t), stale))
		require.NoError(t, other.Release(testCtx(t), l))
		wakeWithin(t, ch, 10*time.Second, "Release")
		require.NoError(t, other.Release(testCtx(t), l)) // already released: no notification
		// The wake-up of a later release proves the earlier one sent none.
		l2 := acquireOK(t, other, "k", "o1", time.Minute)
		noWake(t, ch, "a second release of a released lease, or an acquire")
		waiting(t, b, "k")
		require.NoError(t, other.Release(testCtx(t), l2))
		wakeWithin(t, ch, 10*time.Second, "Release")

		// A release that nobody marked sends nothing; notifications reach
		// the listener in commit order, so once a later marked release of
		// "unrelated" arrives, one from "k" would have arrived too.
		l3 := acquireOK(t, other, "k", "o1", time.Minute)
		require.NoError(t, other.Release(testCtx(t), l3))
		u := acquireOK(t, other, "unrelated", "o1", time.Minute)
		waiting(t, b, "unrelated")
		require.NoError(t, other.Release(testCtx(t), u))
		wakeWithin(t, unrelated, 10*time.Second, "Release of unrelated")
		noWake(t, ch, "a release nobody waited for")
	})

	// Same table name, two schemas (as with a schema per tenant reached
	// through search_path): separate channels.
	t.Run("TablesDoNotCrossTalk", func(t *testing.T) {
		t.Parallel()
		a := newBundle(t, Options{}).backend
		b := newBundle(t, Options{}).backend
		ch, stop := a.Watch("k")
		defer stop()
		marker, stopMarker := a.Watch("marker")
		defer stopMarker()
		listening(t, a, ch, marker)
		bch, stopB := b.Watch("k")
		defer stopB()
		listening(t, b, bch)

		// b's release of "k" notifies (it is marked by a waiter on b), on
		// b's channel only.
		l := acquireOK(t, b, "k", "o1", time.Minute)
		waiting(t, b, "k")
		require.NoError(t, b.Release(testCtx(t), l))
		wakeWithin(t, bch, 10*time.Second, "Release in b's table")
		// Notifications reach a listener in commit order: once the later
		// marker release arrives, any notification of b's release would
		// have arrived too.
		m := acquireOK(t, a, "marker", "o1", time.Minute)
		waiting(t, a, "marker")
		require.NoError(t, a.Release(testCtx(t), m))
		wakeWithin(t, marker, 10*time.Second, "Release of the marker")
		noWake(t, ch, "a release in another schema's table")
	})

	t.Run("ListenerSurvivesTermination", func(t *testing.T) {
		t.Parallel()
		bundle := newBundle(t, Options{})
		b := bundle.backend
		ch, stop := b.Watch("k")
		defer stop()
		listening(t, b, ch)
		pid := b.listener.listeningPID()
		require.NotZero(t, pid)

		var ok bool
		require.NoError(t, bundle.db.Pool.QueryRow(testCtx(t), "SELECT pg_terminate_backend($1)", int32(pid)).Scan(&ok))
		require.True(t, ok)
		// Releases may have been missed while it was away: every waiter is
		// woken once it listens again.
		listening(t, b, ch) // the listener reconnecting after pg_terminate_backend
		require.NotEqual(t, pid, b.listener.listeningPID())

		l := acquireOK(t, b, "k", "o1", time.Minute)
		waiting(t, b, "k")
		require.NoError(t, b.Release(testCtx(t), l))
		wakeWithin(t, ch, 10*time.Second, "Release after the reconnect")
	})

	t.Run("StopAndClose", func(t *testing.T) {
		t.Parallel()
		bundle := newBundle(t, Options{})
		b := bundle.backend
		ch, stop := b.Watch("k")
		listening(t, b, ch)
		stop()
		stop() // idempotent
		l := acquireOK(t, b, "k", "o1", time.Minute)
		require.NoError(t, b.Release(testCtx(t), l))
		// Stopped: the next watcher's wake-up comes, the stopped one's not.
		require.False(t, b.watched("k"), "a stopped watch still marks")
		ch2, stop2 := b.Watch("k")
		defer stop2()
		l = acquireOK(t, b, "k", "o1", time.Minute)
		waiting(t, b, "k")
		require.NoError(t, b.Release(testCtx(t), l))
		wakeWithin(t, ch2, 10*time.Second, "Release")
		noWake(t, ch, "a stopped watch")

		pid := b.listener.listeningPID()
		require.NotZero(t, pid)
		require.NoError(t, b.Close())
		require.NoError(t, b.Close())
		ch3, stop3 := b.Watch("k")
		defer stop3()
		l = acquireOK(t, b, "k", "o1", time.Minute) // still usable after Close
		require.False(t, b.watched("k"), "a watch after Close marks")
		require.NoError(t, b.Release(testCtx(t), l))
		noWake(t, ch3, "a watch after Close")
		// The listening session ends on the server (it notices the closed
		// connection asynchronously, so poll).
		require.Eventually(t, func() bool {
			var n int
			require.NoError(t, bundle.db.Pool.QueryRow(testCtx(t),
				"SELECT count(*) FROM pg_stat_activity WHERE pid = $1", int32(pid)).Scan(&n))
			return n == 0
		}, 10*time.Second, 5*time.Millisecond, "the listening session outlived Close")
	})

	t.Run("DisableNotify", func(t *testing.T) {
		t.Parallel()
		bundle := newBundle(t, Options{DisableNotify: true})
		b := bundle.backend
		require.NotContains(t, b.full.release, "pg_notify")
		ch, stop := b.Watch("k")
		defer stop()
		// A Backend that does notify, on the same table: Watch of the
		// DisableNotify one still never fires (it never listens).
		loud, err := New(bundle.db.Pool, Options{})
		require.NoError(t, err)
		t.Cleanup(func() { loud.Close() })
		loudCh, stopLoud := loud.Watch("k")
		defer stopLoud()
		listening(t, loud, loudCh)
		require.Equal(t, b.full.acquire, b.full.acquireWait, "DisableNotify never marks")
		l := acquireOK(t, loud, "k", "o1", time.Minute)
		waiting(t, loud, "k")
		require.NoError(t, loud.Release(testCtx(t), l))
		wakeWithin(t, loudCh, 10*time.Second, "Release")
		noWake(t, ch, "Watch with DisableNotify")
		require.Nil(t, b.listener)
	})
}
