package postgres

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// TestUpgradeToValue: a table at migration 00003 (before the value column)
// with a lease held by the previous release, upgraded while it is held.
// Before 00004 a Backend serves requests without a value and refuses one
// with a value (ErrSchemaMissing, naming the fix, nothing written); after
// it, the held lease keeps its token, holder and deadline, renews, is
// released by its token, and the next grant continues above it, with a
// value that List and a refused acquirer see.
func TestUpgradeToValue(t *testing.T) {
	t.Parallel()
	db, upgrade := schemaAt(t, 3)
	ctx := testCtx(t)
	_, err := db.Pool.Exec(ctx, `INSERT INTO sqllock_locks (key, token, held, deadline, owner) VALUES
		('a', 7, true, clock_timestamp() + interval '1 hour', 'old-a')`)
	require.NoError(t, err)

	old, err := New(db.Pool, Options{})
	require.NoError(t, err)
	defer old.Close()
	_, err = old.TryAcquire(ctx, sqllock.AcquireRequest{Key: "v", TTL: time.Minute, Owner: "o", Value: []byte("x")})
	require.ErrorIs(t, err, sqllock.ErrSchemaMissing)
	require.Contains(t, err.Error(), "sqllock migrate up")
	var n int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM sqllock_locks`).Scan(&n))
	require.Equal(t, 1, n, "the refused acquire wrote nothing")
	require.True(t, old.stmts.Load().waited, "00003's marks are still used")
	// Without a value, everything works before the migration.
	b1 := acquireOK(t, old, "b", "o", time.Minute)
	require.Nil(t, b1.Value)
	infos, err := old.List(ctx, "")
	require.NoError(t, err)
	require.Len(t, infos, 2)

	upgrade()
	b, err := New(db.Pool, Options{})
	require.NoError(t, err)
	defer b.Close()
	infos, err = b.List(ctx, "a")
	require.NoError(t, err)
	require.Len(t, infos, 1)
	require.True(t, infos[0].Held)
	require.EqualValues(t, 7, infos[0].Token)
	require.Equal(t, "old-a", infos[0].Owner)
	require.Nil(t, infos[0].Value)
	var he *sqllock.HeldError
	_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "a", TTL: time.Minute, Owner: "new", Value: []byte("y")})
	require.ErrorAs(t, err, &he)
	require.EqualValues(t, 7, he.Token)
	require.Nil(t, he.Value)
	held := sqllock.Lease{Key: "a", Token: 7, Owner: "old-a"}
	r, err := b.TryRenew(ctx, held, time.Hour)
	require.NoError(t, err, "the lease held across the upgrade renews")
	require.False(t, r.Deadline.Before(infos[0].Deadline))
	require.NoError(t, b.Release(ctx, held))
	l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "a", TTL: time.Minute, Owner: "new", Value: []byte("10.0.0.7:8080")})
	require.NoError(t, err)
	require.EqualValues(t, 8, l.Token)
	require.Equal(t, []byte("10.0.0.7:8080"), l.Value)
	_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "a", TTL: time.Minute, Owner: "other"})
	require.ErrorAs(t, err, &he)
	require.Equal(t, []byte("10.0.0.7:8080"), he.Value)
	// The Backend built before the migration keeps its forms without the
	// column (requests without a value work) until it is rebuilt.
	acquireOK(t, old, "c", "o", time.Minute)
}
