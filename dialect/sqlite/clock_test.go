package sqlite

import (
	"database/sql/driver"
	"errors"
	"fmt"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	msqlite "modernc.org/sqlite"

	"github.com/ashlock/ashlock/sqllock"
)

// SQLite's clock is the wall clock of the host (README, "What we
// promise"): every process on the host reads the same one, and when it
// steps, every lease on the file moves with it. TestClockStep steps it
// under a holder through a SQL function that adds clockOffsetMS to
// SQLite's own reading.

var clockOffsetMS atomic.Int64

func init() {
	msqlite.MustRegisterScalarFunction("sqllock_test_clock", 1,
		func(_ *msqlite.FunctionContext, args []driver.Value) (driver.Value, error) {
			ms, ok := args[0].(int64)
			if !ok {
				return nil, fmt.Errorf("sqllock_test_clock(%T)", args[0])
			}
			return ms + clockOffsetMS.Load(), nil
		})
}

// openStepped opens a Backend on path whose every statement reads the
// stepped clock, as a process on the stepped host would.
func openStepped(t *testing.T, path string) *Backend {
	t.Helper()
	b, err := Open(path, Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, b.Close()) })
	b.renderQueries("sqllock_test_clock(" + nowMS + ")")
	return b
}

// pollEvery is how often pollAcquire tries.
const pollEvery = 2 * time.Millisecond

// pollAcquire tries to acquire key every pollEvery until granted or until, and
// returns the grant and the wall-clock time just after its reply: the
// database's clock is the host's wall clock, so the times a test compares
// with a deadline are read from it, not from Go's monotonic clock, which a
// slewed or stepped host clock leaves behind by milliseconds.
func pollAcquire(t *testing.T, b *Backend, key, owner string, ttl time.Duration, until time.Time) (sqllock.Lease, time.Time, bool) {
	t.Helper()
	for time.Now().Before(until) {
		l, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: key, TTL: ttl, Owner: owner})
		if err == nil {
			return l, time.Now().Round(0), true
		}
		require.ErrorIs(t, err, sqllock.ErrNotAcquired)
		time.Sleep(pollEvery)
	}
	return sqllock.Lease{}, time.Time{}, false
}

func TestClockStep(t *testing.T) {
	// Not parallel: the subtests step the one clock offset in turn, and no
	// other test reads it.
	defer clockOffsetMS.Store(0)

	// Forward step larger than the margin, under a holder that cannot
	// renew before the stepped deadline (a renewal stalled, or the step
	// bigger than TTL − interval): the database ends the lease while the
	// holder's local deadline is still ahead. That overlap is the
	// documented limit of a clock the database does not own; fencing is
	// what keeps it harmless, so the stale holder's write must be refused.
	t.Run("ForwardOverlapIsFenced", func(t *testing.T) {
		const ttl, step = 2 * time.Second, 800 * time.Millisecond
		margin := ttl/100 + 2*time.Millisecond // the client's default
		var overlap time.Duration
		// A run on a machine so slow that the taker polls only after the
		// holder's local deadline shows no overlap; try again then.
		for attempt := 1; overlap <= 0; attempt++ {
			require.LessOrEqual(t, attempt, 3, "no overlap observed in 3 attempts (machine too slow to poll within %v)", ttl-margin-(ttl-step))
			clockOffsetMS.Store(0)
			path := filepath.Join(t.TempDir(), "locks.db")
			a, b := openStepped(t, path), openStepped(t, path)
			_, err := a.db.ExecContext(testCtx(t), `CREATE TABLE data (id INTEGER PRIMARY KEY, v TEXT NOT NULL, fence INTEGER NOT NULL);
INSERT INTO data VALUES (1, '', 0);`)
			require.NoError(t, err)
			fencedWrite := func(l sqllock.Lease) bool {
				res, err := a.db.ExecContext(testCtx(t), `UPDATE data SET v = ?2, fence = ?1 WHERE id = 1 AND fence <= ?1`, l.Token, l.Owner)
				require.NoError(t, err)
				n, err := res.RowsAffected()
				require.NoError(t, err)
				return n == 1
			}

			sent := time.Now()
			la, err := a.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: ttl, Owner: "A"})
			require.NoError(t, err)
			localDeadline := sent.Add(ttl - margin)
			require.True(t, fencedWrite(la))
			clockOffsetMS.Add(step.Milliseconds())

			lb, grantedAt, ok := pollAcquire(t, b, "k", "B", time.Minute, sent.Add(2*ttl))
			require.True(t, ok, "B never acquired")
			require.Equal(t, la.Token+1, lb.Token)
			overlap = localDeadline.Sub(grantedAt)
			t.Logf("attempt %d: B granted %v after A's request; A's local deadline %v after it: overlap %v",
				attempt, grantedAt.Sub(sent).Round(time.Millisecond), (ttl - margin), overlap.Round(time.Millisecond))
			if overlap <= 0 {
				continue
			}
			// B writes; A, still within its local deadline, writes after.
			// The figures below are counted from what happened, and the
			// assertions come after them, so a failure prints them too.
			var attempted, rejected, applied, anomalies int
			require.True(t, fencedWrite(lb))
			attempted++
			if fencedWrite(la) {
				applied++
				anomalies++
			} else {
				rejected++
			}
			var v string
			require.NoError(t, a.db.QueryRowContext(testCtx(t), `SELECT v FROM data WHERE id = 1`).Scan(&v))
			if v != "B" {
				anomalies++
			}
			_, err = a.TryRenew(testCtx(t), la, ttl)
			var lost *sqllock.LostError
			if !errors.As(err, &lost) || lost.Reason != sqllock.LostTaken {
				anomalies++
			}
			t.Logf("RESULT test=SQ-5/forward backend=sqlite step=%v margin=%v overlap_ms=%d stale_writes={attempted:%d, rejected:%d, applied:%d} anomalies=%d",
				step, margin, overlap.Milliseconds(), attempted, rejected, applied, anomalies)
			require.Zero(t, applied, "A's stale write was applied")
			require.Equal(t, "B", v)
			require.True(t, errors.As(err, &lost), "A's renew: %v", err)
			require.Equal(t, sqllock.LostTaken, lost.Reason)
			require.Zero(t, anomalies)
		}
	})

	// Forward step smaller than TTL − renew interval under a renewing
	// Client: the next renewal restores the lease before the stepped
	// deadline, so nobody else gets the key and the guard stays valid.
	t.Run("ForwardAbsorbedByRenewal", func(t *testing.T) {
		const ttl, step = 3 * time.Second, time.Second // renewals every 1 s
		clockOffsetMS.Store(0)
		path := filepath.Join(t.TempDir(), "locks.db")
		a, b := openStepped(t, path), openStepped(t, path)
		c, err := sqllock.New(a, sqllock.Options{TTL: ttl})
		require.NoError(t, err)
		defer c.Close(testCtx(t))
		g, err := c.TryAcquire(testCtx(t), "k", nil)
		require.NoError(t, err)
		clockOffsetMS.Add(step.Milliseconds())
		_, _, ok := pollAcquire(t, b, "k", "B", time.Minute, time.Now().Add(ttl))
		require.False(t, ok, "B acquired a lease that its renewing holder kept")
		require.NoError(t, g.Err(), "the guard did not survive a %v step", step)
		require.NoError(t, g.Release(testCtx(t)))
	})

	// Backward step of one TTL under a holder that is gone: the lease
	// lasts that much longer in real time, so the takeover is delayed by
	// the step and by no more than B's polling (every pollEvery), one
	// round trip and scheduling: backwardAllowance.
	t.Run("BackwardDelaysTakeover", func(t *testing.T) {
		const ttl, step = 500 * time.Millisecond, 500 * time.Millisecond
		path := filepath.Join(t.TempDir(), "locks.db")
		a, b := openStepped(t, path), openStepped(t, path)
		// Three takeovers: an early grant shows only when one of B's polls
		// lands in its window, which a loaded machine can skip once.
		for i := range 3 {
			clockOffsetMS.Store(0)
			key := fmt.Sprintf("k%d", i)
			sent := time.Now().Round(0) // wall clock, as grantedAt
			la, err := a.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: key, TTL: ttl, Owner: "A"})
			require.NoError(t, err)
			clockOffsetMS.Add(-step.Milliseconds())
			// A is gone: no renewal, no release.
			lb, grantedAt, ok := pollAcquire(t, b, key, "B", time.Minute, sent.Add(ttl+step+10*time.Second))
			require.True(t, ok, "B never acquired")
			require.Equal(t, la.Token+1, lb.Token)
			after := grantedAt.Sub(sent)
			// beyond is how much later than the stepped deadline B got the key.
			beyond := after - ttl - step
			anomalies := 0
			// Never before A's deadline by the database's (stepped) clock:
			// the grant's own time against A's deadline, both read from
			// the database, so that no round trip hides an early grant.
			early := lb.BackendTime.Before(la.Deadline)
			// Liveness: delayed by the step, and by no more than the polling,
			// a round trip and scheduling.
			late := beyond > backwardAllowance
			for _, bad := range []bool{early, late} {
				if bad {
					anomalies++
				}
			}
			t.Logf("RESULT test=SQ-5/backward backend=sqlite step=%v ttl=%v delay_ms=%d beyond_step_ms=%d grant_vs_deadline_ms=%d bound_ms=%d anomalies=%d",
				step, ttl, (after - ttl).Milliseconds(), beyond.Milliseconds(), lb.BackendTime.Sub(la.Deadline).Milliseconds(), backwardAllowance.Milliseconds(), anomalies)
			require.False(t, early, "taken over %v before A's deadline by the database's clock", la.Deadline.Sub(lb.BackendTime))
			require.False(t, late, "taken over %v after the stepped deadline; bound %v", beyond, backwardAllowance)
		}
	})
}

// backwardAllowance bounds how long after the stepped deadline B gets the
// key: its polling (every pollEvery), the acquire's round trip on a local
// file, and scheduling. Measured on a 2-core machine, 20 runs each: at most
// 20 ms idle, 33 ms with both cores busy with other work, 160 ms under
// -race with three busy loops competing for the two cores. The bound is
// 2.5 times the worst of those, and still short of the step itself, so a
// lease that lasts a step longer than the clock says is caught.
const backwardAllowance = 400 * time.Millisecond
