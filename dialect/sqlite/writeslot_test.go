package sqlite

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/outcome"
)

// slotOrder queues writes behind a held write slot, one at a time and in
// the order given (synctest.Wait after each start, so each is waiting
// before the next starts), releases the slot and returns the order in
// which the writes ran. Each op is "a" (acquire), "r" (release) or "n"
// (renewal), numbered by its place in ops.
func slotOrder(t *testing.T, ops ...string) []string {
	t.Helper()
	b := &Backend{}
	ctx := context.Background()
	hold, held := make(chan struct{}), make(chan struct{})
	var wg sync.WaitGroup
	wg.Go(func() {
		require.NoError(t, b.write(ctx, outcome.Acquire, "holder", func(context.Context) error {
			close(held)
			<-hold
			return nil
		}))
	})
	<-held
	var mu sync.Mutex
	var ran []string
	for i, op := range ops {
		o := map[string]outcome.Op{"a": outcome.Acquire, "r": outcome.Release, "n": outcome.Renew}[op]
		name := fmt.Sprintf("%s%d", op, i)
		wg.Go(func() {
			require.NoError(t, b.write(ctx, o, name, func(context.Context) error {
				mu.Lock()
				defer mu.Unlock()
				ran = append(ran, name)
				return nil
			}))
		})
		synctest.Wait()
	}
	close(hold)
	wg.Wait()
	require.False(t, b.writeSlot.held, "the slot is free once every write is done")
	return ran
}

// TestWriteSlotRenewalsFirst: a renewal that waits for the write slot
// behind acquires and releases runs before them (so a flood of acquires
// cannot make held leases expire); the others keep their order.
func TestWriteSlotRenewalsFirst(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		got := slotOrder(t, "a", "a", "r", "a", "n", "a", "n")
		require.Equal(t, []string{"n4", "n6", "a0", "a1", "r2", "a3", "a5"}, got)
	})
}

// TestWriteSlotRenewalRunBounded: renewals pass a waiting acquire at most
// maxRenewRun at a time, so acquires and releases never starve.
func TestWriteSlotRenewalRunBounded(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ops := []string{"a"}
		for range 2*maxRenewRun + 2 {
			ops = append(ops, "n")
		}
		ops = append(ops, "r")
		got := slotOrder(t, ops...)
		want := []string{}
		for i := 1; i <= maxRenewRun; i++ {
			want = append(want, fmt.Sprintf("n%d", i))
		}
		want = append(want, "a0")
		for i := maxRenewRun + 1; i <= 2*maxRenewRun; i++ {
			want = append(want, fmt.Sprintf("n%d", i))
		}
		want = append(want, fmt.Sprintf("r%d", len(ops)-1))
		for i := 2*maxRenewRun + 1; i < len(ops)-1; i++ {
			want = append(want, fmt.Sprintf("n%d", i))
		}
		require.Equal(t, want, got)
	})
}

// TestWriteSlotCancelWhileWaiting: a write whose context ends while it
// waits for the slot is not sent and leaves the line; the slot goes to the
// next waiter. When the slot is handed to a waiter whose context has just
// ended (before the waiter could leave the line), the waiter either runs
// or, not sent, gives the slot on: the slot is never lost.
func TestWriteSlotCancelWhileWaiting(t *testing.T) {
	for _, renewal := range []bool{false, true} {
		o := outcome.Acquire
		if renewal {
			o = outcome.Renew
		}
		t.Run(fmt.Sprint("renewal=", renewal), func(t *testing.T) {
			var ranCancelled, notSent int
			for range 200 {
				synctest.Test(t, func(t *testing.T) {
					b := &Backend{}
					require.True(t, b.writeSlot.take(context.Background(), false))
					ctx, cancel := context.WithCancel(context.Background())
					var cancelledErr, nextErr error
					var cancelledRan bool
					var wg sync.WaitGroup
					wg.Go(func() {
						cancelledErr = b.write(ctx, o, "cancelled", func(context.Context) error {
							cancelledRan = true
							return nil
						})
					})
					synctest.Wait()
					wg.Go(func() {
						nctx, ncancel := context.WithTimeout(context.Background(), time.Second)
						defer ncancel()
						nextErr = b.write(nctx, outcome.Acquire, "next", func(context.Context) error { return nil })
					})
					synctest.Wait()
					// Under the slot's lock, so that the waiter cannot
					// leave the line between the two: the context ends,
					// then the slot is handed to it (first in line).
					b.writeSlot.mu.Lock()
					cancel()
					b.writeSlot.handOff()
					b.writeSlot.mu.Unlock()
					wg.Wait()
					require.NoError(t, nextErr, "the next waiter gets the slot")
					if cancelledRan {
						ranCancelled++
						require.NoError(t, cancelledErr)
					} else {
						notSent++
						require.ErrorIs(t, cancelledErr, context.Canceled)
						require.ErrorContains(t, cancelledErr, `"cancelled": not sent`)
					}
					require.False(t, b.writeSlot.held)
					require.Zero(t, b.writeSlot.renewals.Len()+b.writeSlot.others.Len())
				})
			}
			t.Logf("handed the slot as its context ended: ran %d, not sent %d", ranCancelled, notSent)
			require.NotZero(t, notSent, "the hand-off to a cancelled waiter was never taken")

			// Cancelled while waiting, with no hand-off: not sent, out of the line.
			synctest.Test(t, func(t *testing.T) {
				b := &Backend{}
				require.True(t, b.writeSlot.take(context.Background(), false))
				ctx, cancel := context.WithTimeout(context.Background(), time.Second)
				defer cancel()
				err := b.write(ctx, o, "k", func(context.Context) error { return errors.New("ran") })
				require.ErrorIs(t, err, context.DeadlineExceeded)
				require.ErrorContains(t, err, "not sent")
				require.Zero(t, b.writeSlot.renewals.Len()+b.writeSlot.others.Len())
				b.writeSlot.give()
				require.False(t, b.writeSlot.held)
			})
		})
	}
}

// TestWriteSlotStress: many goroutines, renewals and others, contexts that
// end at random moments: never two holders of the slot at once, and at the
// end the slot is free and no one waits (none leaked). Run it with -race.
func TestWriteSlotStress(t *testing.T) {
	b := &Backend{}
	var holders, ran, cancelled atomic.Int64
	var wg sync.WaitGroup
	for g := range 32 {
		wg.Go(func() {
			for range 200 {
				o := outcome.Acquire
				if rand.N(4) == 0 {
					o = outcome.Renew
				}
				ctx, cancel := context.WithTimeout(context.Background(), rand.N(2*time.Millisecond))
				err := b.write(ctx, o, fmt.Sprint(g), func(context.Context) error {
					if n := holders.Add(1); n != 1 {
						t.Errorf("%d holders of the write slot", n)
					}
					time.Sleep(rand.N(20 * time.Microsecond))
					holders.Add(-1)
					ran.Add(1)
					return nil
				})
				cancel()
				if err != nil {
					require.ErrorContains(t, err, "not sent")
					cancelled.Add(1)
				}
			}
		})
	}
	wg.Wait()
	t.Logf("ran %d, not sent %d", ran.Load(), cancelled.Load())
	require.NotZero(t, ran.Load())
	require.NotZero(t, cancelled.Load())
	b.writeSlot.mu.Lock()
	defer b.writeSlot.mu.Unlock()
	require.False(t, b.writeSlot.held, "slot leaked")
	require.Zero(t, b.writeSlot.renewals.Len()+b.writeSlot.others.Len())
}
