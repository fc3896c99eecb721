package sqllock

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"
)

type ctxKey struct{}

func newRC(parent context.Context, timeout time.Duration) *releaseCtx {
	rc := new(releaseCtx)
	rc.init(parent, timeout)
	return rc
}

// A release context answers as context.WithTimeout would, whether or not
// anything asked for its channel: Err, Done, Deadline, Value and
// context.Cause agree at every step, and Err never changes once non-nil.
func TestReleaseCtxAsWithTimeout(t *testing.T) {
	t.Parallel()
	for _, done := range []bool{false, true} { // Done asked for before the end, or not
		t.Run(map[bool]string{false: "polled", true: "channel"}[done], func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				// A parent that can end: context.Cause asks it (through
				// Value) for its cancellation state while this one lives.
				parent, cancel := context.WithCancel(context.WithValue(context.Background(), ctxKey{}, "v"))
				defer cancel()
				start := time.Now()
				rc := newRC(parent, time.Second)
				var ch <-chan struct{}
				if done {
					ch = rc.Done()
				}
				d, ok := rc.Deadline()
				require.True(t, ok)
				require.Equal(t, start.Add(time.Second), d)
				require.Equal(t, "v", rc.Value(ctxKey{}))
				require.NoError(t, rc.Err())
				require.NoError(t, context.Cause(rc))

				time.Sleep(999 * time.Millisecond)
				require.NoError(t, rc.Err(), "ended before its deadline")
				time.Sleep(time.Millisecond)
				if done {
					// The timer's goroutine ends the made context, as it
					// ends a context.WithTimeout.
					synctest.Wait()
				} else {
					// Nothing asked for a channel: Cause, which asks
					// Value, sees the end as Err does.
					require.ErrorIs(t, context.Cause(rc), context.DeadlineExceeded)
				}
				require.ErrorIs(t, rc.Err(), context.DeadlineExceeded)
				require.ErrorIs(t, context.Cause(rc), context.DeadlineExceeded)
				require.Equal(t, "v", rc.Value(ctxKey{}))
				if done {
					requireClosed(t, ch)
				}
				requireClosed(t, rc.Done())
				rc.stop()
				require.ErrorIs(t, rc.Err(), context.DeadlineExceeded, "Err changed after it was non-nil")
			})
		})
	}
}

func requireClosed(t *testing.T, ch <-chan struct{}) {
	t.Helper()
	select {
	case <-ch:
	default:
		t.Fatal("Done is not closed")
	}
}

// stop ends the context as a context.CancelFunc does, whether the channel
// was made before or after it.
func TestReleaseCtxStop(t *testing.T) {
	t.Parallel()
	rc := newRC(context.Background(), time.Hour)
	rc.stop()
	require.ErrorIs(t, rc.Err(), context.Canceled)
	require.ErrorIs(t, context.Cause(rc), context.Canceled)
	requireClosed(t, rc.Done())

	rc = newRC(context.Background(), time.Hour)
	ch := rc.Done()
	rc.stop()
	requireClosed(t, ch)
	require.ErrorIs(t, rc.Err(), context.Canceled)
}

// The parent's end ends it, with the parent's error and cause, and an
// earlier parent deadline is its deadline.
func TestReleaseCtxParent(t *testing.T) {
	t.Parallel()
	cause := errors.New("the caller gave up")
	parent, cancel := context.WithCancelCause(context.Background())
	rc := newRC(parent, time.Hour)
	require.NoError(t, rc.Err())
	cancel(cause)
	require.ErrorIs(t, rc.Err(), context.Canceled)
	require.ErrorIs(t, context.Cause(rc), cause)
	requireClosed(t, rc.Done())

	dl := time.Now().Add(time.Minute)
	parent2, cancel2 := context.WithDeadline(context.Background(), dl)
	defer cancel2()
	d, _ := newRC(parent2, time.Hour).Deadline()
	require.Equal(t, dl, d)
}

// A context derived from it ends with it (the backends derive theirs).
func TestReleaseCtxChild(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		rc := newRC(context.Background(), time.Second)
		child, cancel := context.WithCancel(rc)
		defer cancel()
		time.Sleep(time.Second)
		synctest.Wait()
		requireClosed(t, child.Done())
		require.ErrorIs(t, child.Err(), context.DeadlineExceeded)
		rc.stop()
	})
}

// Concurrent use, for the race detector: every reader sees one end.
func TestReleaseCtxConcurrent(t *testing.T) {
	t.Parallel()
	for range 100 {
		rc := newRC(context.Background(), time.Microsecond)
		var wg sync.WaitGroup
		errs := make([]error, 4)
		for i := range errs {
			wg.Go(func() {
				if i%2 == 0 {
					<-rc.Done()
				} else {
					for rc.Err() == nil {
					}
				}
				errs[i] = rc.Err()
			})
		}
		wg.Go(func() {
			time.Sleep(time.Microsecond)
			rc.stop()
		})
		wg.Wait()
		for _, err := range errs {
			require.Equal(t, errs[0], err, "two readers saw different ends")
		}
		require.Equal(t, errs[0], rc.Err())
	}
}
