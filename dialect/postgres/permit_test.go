package postgres

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

func permitOK(t *testing.T, b *Backend, sem string, n int, owner string) sqllock.Lease {
	t.Helper()
	l, err := b.TryAcquirePermit(testCtx(t), sqllock.PermitRequest{
		AcquireRequest: sqllock.AcquireRequest{Key: sem, TTL: time.Hour, Owner: owner}, Permits: n})
	require.NoError(t, err)
	return l
}

// TestRefusedPermitWritesNothing: a permit acquire refused because every
// permit is held assigns no transaction id (so it locks no row) and no
// node of its plan writes WAL, in its plain form; a grant does write (the
// count sees the statement's CTEs).
func TestRefusedPermitWritesNothing(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	permitOK(t, b, "sem", 2, "h1")
	permitOK(t, b, "sem", 2, "h2")
	args := func(owner string) []any { return []any{"sem", int64(60_000_000), owner, nil, 2} }

	tx, err := bundle.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	for i := range 5 {
		var r permitRow
		require.NoError(t, tx.QueryRow(ctx, b.permit.acquire, args(fmt.Sprint("w", i))...).
			Scan(&r.key, &r.token, &r.deadline, &r.now, &r.permits, &r.free, &r.exhausted, &r.holders))
		require.Empty(t, r.key, "a held semaphore granted a permit")
		require.EqualValues(t, 2, r.permits)
	}
	var xid *int64
	require.NoError(t, tx.QueryRow(ctx, "SELECT pg_current_xact_id_if_assigned()::text::bigint").Scan(&xid))
	require.Nil(t, xid, "a refused permit acquire assigned a transaction id")
	require.NoError(t, tx.Rollback(ctx))

	records, bytes := planWAL(t, b, b.permit.acquire, args("w")...)
	require.Zero(t, records, "a refused permit acquire wrote WAL (%d bytes)", bytes)
	records, _ = planWAL(t, b, b.permit.acquire, "free", int64(60_000_000), "w", nil, 2)
	require.Positive(t, records, "control: a granting permit acquire should write WAL")
}

// TestPermitSkipsLockedRows: a permit row another transaction has locked
// is skipped, not waited for: the acquire takes another free permit, or,
// when the locked one was the only free one, is refused at once with no
// holder named (try again).
func TestPermitSkipsLockedRows(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	l := permitOK(t, b, "sem", 2, "first")
	require.NoError(t, b.Release(ctx, l))

	tx, err := bundle.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	_, err = tx.Exec(ctx, fmt.Sprintf("SELECT 1 FROM %s WHERE key = $1 FOR UPDATE", b.table), sqllock.PermitKey("sem", 1))
	require.NoError(t, err)

	short, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	got, err := b.TryAcquirePermit(short, sqllock.PermitRequest{
		AcquireRequest: sqllock.AcquireRequest{Key: "sem", TTL: time.Hour, Owner: "second"}, Permits: 2})
	require.NoError(t, err, "waited on the locked permit row")
	require.Equal(t, sqllock.PermitKey("sem", 2), got.Key)

	_, err = b.TryAcquirePermit(short, sqllock.PermitRequest{
		AcquireRequest: sqllock.AcquireRequest{Key: "sem", TTL: time.Hour, Owner: "third"}, Permits: 2})
	var pe *sqllock.PermitsHeldError
	require.True(t, errors.As(err, &pe), "got %v, want a refusal", err)
	require.Empty(t, pe.Holders, "the only free permit is locked: a refusal that names no holder (try again)")
	require.NoError(t, short.Err())
	require.NoError(t, tx.Rollback(ctx))
	permitOK(t, b, "sem", 2, "third")
}

// TestPermitFirstUseRace: two first grants of one semaphore at once. The
// first, in a transaction held open, has created the semaphore; the
// second's insert of the limit waits for it and, once it commits, does
// nothing. The second still gets one of the free permits, not a refusal
// that says every permit is held.
func TestPermitFirstUseRace(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	tx, err := bundle.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	var r permitRow
	require.NoError(t, tx.QueryRow(ctx, b.permit.acquire, "sem", int64(60_000_000), "first", nil, 3).
		Scan(&r.key, &r.token, &r.deadline, &r.now, &r.permits, &r.free, &r.exhausted, &r.holders))
	require.Equal(t, sqllock.PermitKey("sem", 1), r.key)

	type result struct {
		l   sqllock.Lease
		err error
	}
	done := make(chan result, 1)
	go func() {
		l, err := b.TryAcquirePermit(ctx, sqllock.PermitRequest{
			AcquireRequest: sqllock.AcquireRequest{Key: "sem", TTL: time.Hour, Owner: "second"}, Permits: 3})
		done <- result{l, err}
	}()
	// The second statement is waiting on the first's uncommitted limit row.
	require.Eventually(t, func() bool {
		var waiting int
		err := bundle.db.Pool.QueryRow(ctx, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()").Scan(&waiting)
		return err == nil && waiting > 0
	}, 10*time.Second, 5*time.Millisecond, "the second grant never waited for the first")
	require.NoError(t, tx.Commit(ctx))
	got := <-done
	require.NoError(t, got.err, "a semaphore with 2 free permits refused its second first-use grant")
	require.Equal(t, sqllock.PermitKey("sem", 2), got.l.Key)
}

// TestPermitNeedsLatestSchema: on a table before migration 00005 a permit
// acquire is refused, naming the migration, and sends nothing but the
// schema read.
func TestPermitNeedsLatestSchema(t *testing.T) {
	t.Parallel()
	db, _ := schemaAt(t, 4)
	b, err := New(db.Pool, Options{})
	require.NoError(t, err)
	defer b.Close()
	_, err = b.TryAcquirePermit(testCtx(t), sqllock.PermitRequest{
		AcquireRequest: sqllock.AcquireRequest{Key: "sem", TTL: time.Hour, Owner: "o"}, Permits: 2})
	require.ErrorIs(t, err, sqllock.ErrSchemaMissing)
	require.ErrorContains(t, err, "00005")
	var n int
	require.NoError(t, db.Pool.QueryRow(testCtx(t), fmt.Sprintf("SELECT count(*) FROM %s", b.table)).Scan(&n))
	require.Zero(t, n)
}
