package integration

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/history"
	"github.com/ashlock/ashlock/sqllock"
)

// TestRobustRowLockStall is PG-5a: another session locks A's lease row FOR
// UPDATE for TTL+margin: its last renewal before the stall was sent before
// the stall began, so the stall outlasts A's local deadline by at least
// twice the margin and the lease's database deadline by at least the margin.
// A's renewals wait on the row lock, each one returns by A's local deadline
// (+ scheduling slack), the guard ends by its local deadline, and no renewal
// that was waiting commits after the lock is released.
func TestRobustRowLockStall(t *testing.T) {
	t.Parallel()
	const key = "pg5a"
	w := newRobustWorld(t, "PG-5a", 0, robustTTL, robustParams)
	ctx, cancel := context.WithTimeout(t.Context(), 40*time.Second)
	defer cancel()
	a := w.client(false, robustOpts())
	ga, gidA, err := w.hold(ctx, a, key, 0, true)
	require.NoError(t, err)
	pause(ctx, 700*time.Millisecond)
	require.NoError(t, ga.Err())

	tx, err := w.db.Pool.Begin(ctx)
	require.NoError(t, err)
	_, err = tx.Exec(ctx, "SELECT 1 FROM sqllock_locks WHERE key = $1 FOR UPDATE", key)
	require.NoError(t, err)
	stallStart := w.rec.Now()
	pause(ctx, w.ttl+robustSettings.margin)
	require.NoError(t, tx.Commit(ctx))
	var released time.Time
	require.NoError(t, w.db.Pool.QueryRow(ctx, "SELECT clock_timestamp()").Scan(&released))
	require.Error(t, ga.Err(), "A's guard outlived a stall of TTL+margin")
	var le *sqllock.LostError
	require.ErrorAs(t, ga.Err(), &le)
	pause(ctx, 500*time.Millisecond) // let anything still waiting commit
	var late int
	require.NoError(t, w.db.Pool.QueryRow(ctx,
		"SELECT count(*) FROM robust_audit WHERE key = $1 AND token = $2 AND kind = 'renew' AND at > $3", key, ga.Token(), released).Scan(&late))
	_ = ga.Release(ctx)

	h, r := w.check(ctx, "go test ./integration -run '^TestRobustRowLockStall$' -v")
	gA := guardOf(h, gidA)
	var blocked int
	var worst time.Duration
	for _, op := range h.Ops {
		if op.Client != a.id || op.Kind != history.Renew || op.Call < stallStart || op.Call > gA.End {
			continue
		}
		blocked++
		worst = max(worst, time.Duration(op.Return-op.Call))
		require.LessOrEqual(t, op.Return, gA.LocalDeadline+int64(cancelSlack), "a renewal returned after the local deadline + %v", cancelSlack)
	}
	require.Positive(t, blocked)
	require.Zero(t, late, "a renewal that waited on the row lock committed after the lock was released")
	faults := map[string]int{"row_lock_stall": 1}
	t.Log(w.figures("TestRobustRowLockStall", h, r, faults,
		fmt.Sprintf("blocked_renews=%d max_renew_latency=%v loss=%s late_commits=%d", blocked, worst.Round(time.Millisecond), le.Reason, late)))
	robustRequireFired(t, faults)
}

// TestRobustStatementTimeout is PG-5b: with statement_timeout at 1ms,
// every operation either succeeds (and the audit log shows it applied) or
// fails as canceled or unavailable without having been applied: never a
// false success, never a false failure.
func TestRobustStatementTimeout(t *testing.T) {
	t.Parallel()
	w := newRobustWorld(t, "PG-5b", 0, robustTTL, robustParams)
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	// The lock table gets a slow trigger, so that the timeout fires in
	// the middle of the statements, after their row changes.
	_, err := w.db.Pool.Exec(ctx, `
		CREATE FUNCTION robust_slow() RETURNS trigger LANGUAGE plpgsql AS $$
		BEGIN PERFORM pg_sleep(random() * 0.002); RETURN NULL; END $$;
		CREATE TRIGGER robust_slow AFTER UPDATE OR INSERT ON sqllock_locks FOR EACH ROW EXECUTE FUNCTION robust_slow();`)
	require.NoError(t, err)
	a := w.clientConns(false, 4, map[string]string{"statement_timeout": "1ms"}, robustOpts())
	counts := map[string]int{}
	for i := range 100 {
		key := fmt.Sprintf("pg5b-%d", i%5)
		req := sqllock.AcquireRequest{Key: key, TTL: w.ttl, Owner: fmt.Sprintf("pg5b/%d", i)}
		l, err := a.fb.TryAcquire(ctx, req)
		counts[string(history.Classify(err))]++
		if err == nil {
			err = a.fb.Release(ctx, l)
			counts["release_"+string(history.Classify(err))]++
		} else if !errors.Is(err, sqllock.ErrNotAcquired) {
			require.ErrorIs(t, err, sqllock.ErrUnavailable, "a timeout must be a transient error: %v", err)
		}
	}
	h, r := w.check(ctx, "go test ./integration -run '^TestRobustStatementTimeout$' -v")
	timeouts, falseSuccess, falseFailure := 0, 0, 0
	for _, op := range h.Ops {
		switch {
		case op.Outcome == history.OK && op.Kind != history.Release && op.Audit == 0:
			falseSuccess++
		case op.Outcome == history.Unavailable:
			timeouts++
			if op.Audit != 0 {
				falseFailure++
			}
		}
	}
	require.Zero(t, falseSuccess, "an operation reported success but was not applied")
	require.Zero(t, falseFailure, "an operation reported canceled but was applied")
	faults := map[string]int{"statement_timeout": timeouts}
	t.Log(w.figures("TestRobustStatementTimeout", h, r, faults, fmt.Sprintf("outcomes=%v", counts)))
	robustRequireFired(t, faults)
}
