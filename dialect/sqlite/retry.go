package sqlite

import (
	"context"
	"errors"
	"math/rand/v2"
	"time"

	"github.com/ashlock/ashlock/internal/wait"
)

// write runs op, one attempt of an operation that writes, holding the
// Backend's write slot, retrying while the database is busy.
func (b *Backend) write(ctx context.Context, op func(context.Context) error) error {
	if b.closed.Load() {
		return errClosed
	}
	if ctx.Err() != nil {
		return &notSentError{cause: context.Cause(ctx)}
	}
	select {
	case b.writeSlot <- struct{}{}:
	case <-ctx.Done():
		return &notSentError{cause: context.Cause(ctx)}
	}
	defer func() { <-b.writeSlot }()
	return b.retry(ctx, b.retryTimeout, op)
}

// read runs op, a read-only attempt, retrying while the database is busy.
func (b *Backend) read(ctx context.Context, op func(context.Context) error) error {
	if b.closed.Load() {
		return errClosed
	}
	if ctx.Err() != nil {
		return &notSentError{cause: context.Cause(ctx)}
	}
	return b.retry(ctx, b.retryTimeout, op)
}

// maxRowChanges bounds the errRetry loop; the row cannot keep moving back.
const maxRowChanges = 10

// retry runs op until it returns something other than a busy error, for
// at most budget, sleeping with full jitter in between. op gets ctx: its
// statements shield themselves from it once they run (see shield); ctx is
// also checked between attempts.
func (b *Backend) retry(ctx context.Context, budget time.Duration, op func(context.Context) error) error {
	start := time.Now()
	changes := 0
	for attempt := 1; ; attempt++ {
		err := op(ctx)
		if errors.Is(err, errRetry) && changes < maxRowChanges {
			changes++
			continue
		}
		if err == nil || !isBusy(err) {
			return err
		}
		b.busyRetries.Add(1)
		waited := time.Since(start)
		if waited >= budget {
			return &busyError{attempts: attempt, waited: waited, last: err}
		}
		// Full jitter over an exponential cap: 1, 2, 4 ... 32 ms.
		limit := time.Millisecond << min(attempt-1, 5)
		if wait.Sleep(ctx, rand.N(limit)+100*time.Microsecond) != nil {
			return &busyError{attempts: attempt, waited: time.Since(start), last: err, ctxErr: ctx.Err()}
		}
	}
}
