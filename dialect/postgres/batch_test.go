package postgres

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// A batch renewal commits synchronously whatever the session says, as a
// single renewal does ({{durable}}): a renewal a crash took back would move
// deadlines back under their guards' local deadlines (G3).
func TestBatchRenewalIsDurable(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	l1 := acquireOK(t, b, "a", "o", time.Minute)
	l2 := acquireOK(t, b, "b", "o", time.Minute)
	tx, err := bundle.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	_, err = tx.Exec(ctx, "SET LOCAL synchronous_commit = off")
	require.NoError(t, err)
	// The Backend's own statement, bound as TryRenewBatch binds it.
	rows, err := tx.Query(ctx, b.full.renewBatch, []string{l1.Key, l2.Key}, []int64{l1.Token, l2.Token},
		[]int64{leaseMicros(time.Minute), leaseMicros(time.Minute)})
	require.NoError(t, err)
	renewed := 0
	for rows.Next() {
		vals, err := rows.Values()
		require.NoError(t, err)
		if vals[2] == true {
			renewed++
		}
	}
	require.NoError(t, rows.Err())
	require.Equal(t, 2, renewed)
	var s string
	require.NoError(t, tx.QueryRow(ctx, "SHOW synchronous_commit").Scan(&s))
	require.Equal(t, "on", s, "a batch renewal must commit synchronously")
}

// A row locked by another transaction (a fenced transaction holds its
// lease's row FOR SHARE) is skipped, not waited for: the other leases of
// the batch are renewed at once, and the skipped one is a transient error
// of its own (the client renews it alone), never a loss.
func TestBatchSkipsLockedRow(t *testing.T) {
	t.Parallel()
	for _, f := range flavours {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			bundle, b := f.bundle(t, Options{})
			batchSkipsLockedRow(t, bundle, b)
		})
	}
}

func batchSkipsLockedRow(t *testing.T, bundle *testBundle, b *Backend) {
	ctx := testCtx(t)
	locked := acquireOK(t, b, "locked", "o", time.Minute)
	free := acquireOK(t, b, "free", "o", time.Minute)
	tx := holdRows(t, bundle.db.Pool, b.table, "FOR SHARE", "locked")

	bctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	res, err := b.TryRenewBatch(bctx, []sqllock.RenewRequest{{Lease: locked, TTL: 2 * time.Minute}, {Lease: free, TTL: 2 * time.Minute}})
	require.NoError(t, err, "the batch waited for the locked row")
	require.NoError(t, res[1].Err)
	require.Greater(t, res[1].Lease.Deadline.Sub(res[1].Lease.BackendTime), time.Minute)
	require.ErrorIs(t, res[0].Err, sqllock.ErrUnavailable)
	require.NotErrorIs(t, res[0].Err, sqllock.ErrLeaseLost)

	// Alone, the renewal waits for the row and succeeds.
	done := make(chan error, 1)
	go func() {
		_, err := b.TryRenew(ctx, locked, 2*time.Minute)
		done <- err
	}()
	time.Sleep(100 * time.Millisecond)
	require.NoError(t, tx.Commit(ctx))
	require.NoError(t, <-done)
}

// greatest(): a batch never moves a deadline back, also when it asks for a
// shorter TTL than the lease's last renewal gave it.
func TestBatchDeadlineNeverMovesBack(t *testing.T) {
	t.Parallel()
	for _, f := range flavours {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			bundle, b := f.bundle(t, Options{})
			batchDeadlineNeverMovesBack(t, bundle, b)
		})
	}
}

func batchDeadlineNeverMovesBack(t *testing.T, bundle *testBundle, b *Backend) {
	ctx := testCtx(t)
	l := acquireOK(t, b, "k", "o", time.Minute)
	long, err := b.TryRenew(ctx, l, time.Hour)
	require.NoError(t, err)
	res, err := b.TryRenewBatch(ctx, []sqllock.RenewRequest{{Lease: l, TTL: time.Second}})
	require.NoError(t, err)
	require.NoError(t, res[0].Err)
	require.False(t, res[0].Lease.Deadline.Before(long.Deadline), "the batch moved the deadline back from %v to %v", long.Deadline, res[0].Lease.Deadline)
	var deadline time.Time
	require.NoError(t, adminPool(b).QueryRow(ctx, "SELECT deadline FROM "+b.table+" WHERE key = 'k'").Scan(&deadline))
	require.True(t, deadline.Equal(long.Deadline), "deadline %v, want %v", deadline, long.Deadline)
}
