package sqlite

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// TestNoGrantBeforeSendTimePlusTTL (G1, G3; issue: SQLite's clock has
// millisecond resolution). A takes the key with a short TTL; B polls it as
// fast as it can. B's grant must come after A's send time + TTL: that is
// A's local deadline with no margin at all, so no margin the client
// accepts can let the two overlap. B's grant happened before B's reply, so
// a reply earlier than A's send time + TTL proves an early grant. With now
// truncated to the millisecond and only the TTL rounded up, the database's
// deadline could fall up to 1 ms before A's send time + TTL.
func TestNoGrantBeforeSendTimePlusTTL(t *testing.T) {
	t.Parallel()
	b, _ := openTest(t, Options{Synchronous: SynchronousNormal}) // fast writes: fine-grained polling
	ctx := testCtx(t)
	const (
		rounds = 200
		ttl    = 5*time.Millisecond + 500*time.Microsecond // not whole milliseconds: rounding matters
	)
	early, worst := 0, time.Duration(0)
	for i := range rounds {
		sentA := time.Now()
		_, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: ttl, Owner: "a"})
		require.NoError(t, err, "round %d", i)
		for {
			_, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Millisecond, Owner: "b"})
			replyB := time.Now()
			if errors.Is(err, sqllock.ErrNotAcquired) {
				continue
			}
			require.NoError(t, err)
			if d := sentA.Add(ttl).Sub(replyB); d > 0 {
				early++
				worst = max(worst, d)
			}
			break
		}
		// B's 1 ms lease (2 ms at the database) ends before A's next round.
		time.Sleep(3 * time.Millisecond)
	}
	t.Logf("RESULT test=TestNoGrantBeforeSendTimePlusTTL rounds=%d ttl=%v early_grants=%d worst=%v", rounds, ttl, early, worst)
	require.Zero(t, early, "B was granted the key before A's send time + TTL (worst by %v)", worst)
}
