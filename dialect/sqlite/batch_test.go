package sqlite

import (
	"database/sql/driver"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	msqlite "modernc.org/sqlite"

	"github.com/ashlock/ashlock/sqllock"
)

// TestRenewBatchPlan: the batch statement reaches each row through the
// primary key, one lookup per lease; a scan of the table per lease would
// make a batch of n leases on a table of m rows cost n × m.
func TestRenewBatchPlan(t *testing.T) {
	t.Parallel()
	b, _ := openTest(t, Options{})
	rows, err := b.db.QueryContext(testCtx(t), "EXPLAIN QUERY PLAN "+b.renewBatchSQL, `[["k",1,1000]]`, int64(0))
	require.NoError(t, err)
	defer rows.Close()
	var plan []string
	for rows.Next() {
		var id, parent, unused int
		var detail string
		require.NoError(t, rows.Scan(&id, &parent, &unused, &detail))
		plan = append(plan, detail)
	}
	require.NoError(t, rows.Err())
	t.Logf("plan: %q", plan)
	var searched bool
	for _, step := range plan {
		require.False(t, strings.HasPrefix(step, "SCAN l"), "the lock table is scanned: %q", plan)
		searched = searched || strings.HasPrefix(step, "SEARCH l USING") && strings.Contains(step, "(key=?)")
	}
	require.True(t, searched, "no lookup of the lock table by key: %q", plan)
}

// TestRenewBatchWritesOnlyRenewals: a batch commits once, and a batch whose
// leases are all lost (released, taken, expired, unknown) commits nothing:
// another connection's PRAGMA data_version does not move (as for the
// single statements, TestRefusedOperationsWriteNothing).
func TestRenewBatchWritesOnlyRenewals(t *testing.T) {
	t.Parallel()
	b, path := openTest(t, Options{})
	ctx := testCtx(t)
	version := dataVersion(t, path)
	var live, stale []sqllock.RenewRequest
	for i := range 300 {
		key := fmt.Sprintf("k%03d", i)
		l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: "o1"})
		require.NoError(t, err)
		switch i % 3 {
		case 0:
			live = append(live, sqllock.RenewRequest{Lease: l, TTL: 2 * time.Minute})
		case 1:
			require.NoError(t, b.Release(ctx, l))
			stale = append(stale, sqllock.RenewRequest{Lease: l, TTL: 2 * time.Minute})
		case 2:
			execTest(t, b, expireSQL, key)
			stale = append(stale, sqllock.RenewRequest{Lease: l, TTL: 2 * time.Minute})
		}
	}
	unknown := sqllock.Lease{Key: "never", Token: 1, Owner: "o1", Deadline: time.Now(), BackendTime: time.Now()}
	stale = append(stale, sqllock.RenewRequest{Lease: unknown, TTL: time.Minute})

	v := version()
	res, err := b.TryRenewBatch(ctx, stale)
	require.NoError(t, err)
	for i, r := range res {
		require.ErrorIs(t, r.Err, sqllock.ErrLeaseLost, "element %d", i)
	}
	require.Equal(t, v, version(), "a batch of lost leases committed a change")

	res, err = b.TryRenewBatch(ctx, append(live, stale...))
	require.NoError(t, err)
	for i, r := range res[:len(live)] {
		require.NoError(t, r.Err, "element %d", i)
	}
	require.NotEqual(t, v, version(), "a batch of renewals committed nothing")
}

// TestRenewBatchKeysAsJSON: keys travel to the batch statement inside a
// JSON array; every valid key comes back as itself, whatever JSON escapes
// for it (quotes, backslashes, HTML characters, control and line-separator
// characters, non-ASCII text).
func TestRenewBatchKeysAsJSON(t *testing.T) {
	t.Parallel()
	b, _ := openTest(t, Options{})
	ctx := testCtx(t)
	keys := []string{`"quoted"`, `back\slash`, "<a&b>", "tab\there\nnewline", "line\u2028sep", "ключ/鍵/🔑", "\x01ctl", "plain"}
	var reqs []sqllock.RenewRequest
	for _, key := range keys {
		l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: "o1"})
		require.NoError(t, err, "%q", key)
		reqs = append(reqs, sqllock.RenewRequest{Lease: l, TTL: 2 * time.Minute})
	}
	res, err := b.TryRenewBatch(ctx, reqs)
	require.NoError(t, err)
	for i, r := range res {
		require.NoError(t, r.Err, "%q", keys[i])
		require.Equal(t, keys[i], r.Lease.Key)
		require.Greater(t, r.Lease.Deadline.Sub(r.Lease.BackendTime), time.Minute, "%q renewed", keys[i])
	}
}

// tickMS is how far sqllock_test_tick's clock has moved ahead: each call
// moves it one more second, so two reads of it never agree.
var tickMS atomic.Int64

func init() {
	msqlite.MustRegisterScalarFunction("sqllock_test_tick", 1,
		func(_ *msqlite.FunctionContext, args []driver.Value) (driver.Value, error) {
			ms, ok := args[0].(int64)
			if !ok {
				return nil, fmt.Errorf("sqllock_test_tick(%T)", args[0])
			}
			return ms + tickMS.Add(1000), nil
		})
}

// A batch renewal reads the database clock once: the new deadline is the
// instant it reports plus the TTL (in leaseMillis), to the millisecond, also on a clock
// that moves between any two reads of it (a second read for the deadline
// would set it later than the instant the guard counts from says).
func TestRenewBatchOneClockInstant(t *testing.T) {
	t.Parallel()
	const renewTTL = 10 * time.Minute // later than any deadline the ticks make
	b, path := openTest(t, Options{})
	var reqs []sqllock.RenewRequest
	for _, key := range []string{"a", "b"} {
		l, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: "o1"})
		require.NoError(t, err)
		reqs = append(reqs, sqllock.RenewRequest{Lease: l, TTL: renewTTL})
	}
	ticking, err := Open(path, Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, ticking.Close()) })
	ticking.renderQueries("sqllock_test_tick(" + nowMS + ")")

	res, err := ticking.TryRenewBatch(testCtx(t), reqs)
	require.NoError(t, err)
	for _, r := range res {
		require.NoError(t, r.Err)
		require.Equal(t, r.Lease.BackendTime.Add(time.Duration(leaseMillis(renewTTL))*time.Millisecond), r.Lease.Deadline,
			"%s: the deadline is not the batch's one instant plus the TTL", r.Lease.Key)
	}
}
