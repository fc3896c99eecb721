package postgres

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/groupcommit"
	"github.com/ashlock/ashlock/sqllock"
)

// Minimum holds (migration 00005's hold_until) in the group commit's batch
// statements, and the upgrade to 00005. The single statements keep the
// rules of the conformance suite (TestConformance/MinHold...), which never
// makes a batch.

func goAcquireReq(ctx context.Context, b *Backend, req sqllock.AcquireRequest) chan acquireResult {
	ch := make(chan acquireResult, 1)
	go func() {
		l, err := b.TryAcquire(ctx, req)
		ch <- acquireResult{l, err}
	}()
	return ch
}

// acquireBatch sends reqs as one acquire_batch.sql and returns their answers.
func acquireBatch(t *testing.T, b *Backend, reqs ...sqllock.AcquireRequest) []acquireResult {
	t.Helper()
	ctx := testCtx(t)
	return oneBatch(t, b.acquireQ, reqs, func(req sqllock.AcquireRequest) chan acquireResult { return goAcquireReq(ctx, b, req) })
}

// releaseBatch sends ls as one release_batch.sql and returns their answers.
func releaseBatch(t *testing.T, b *Backend, ls ...sqllock.Lease) []error {
	t.Helper()
	ctx := testCtx(t)
	return oneBatch(t, b.releaseQ, ls, func(l sqllock.Lease) chan error { return goRelease(ctx, b, l) })
}

// oneBatch sends each of ins through send while q is held, so that they
// queue, lets them go as one batch statement, and returns their answers
// in order.
func oneBatch[Req, Res, In, Out any](t *testing.T, q *groupcommit.Queue[Req, Res], ins []In, send func(In) chan Out) []Out {
	t.Helper()
	batches := q.Batches()
	holdQueue(q)
	chs := make([]chan Out, len(ins))
	for i, in := range ins {
		chs[i] = send(in)
		waitQueued(t, q, i+1)
	}
	flushQueue(q)
	out := make([]Out, len(ins))
	for i, ch := range chs {
		out[i] = recv(t, ch)
	}
	unholdQueue(t, q)
	require.Equal(t, batches+1, q.Batches(), "one batch")
	return out
}

// listed is key's row as List reports it.
func listed(t *testing.T, b *Backend, key string) sqllock.LockInfo {
	t.Helper()
	infos, err := b.List(testCtx(t), key)
	require.NoError(t, err)
	for _, i := range infos {
		if i.Key == key {
			return i
		}
	}
	t.Fatalf("List: no %q", key)
	panic("unreachable")
}

// requireHeldUntil checks that l's key is held by l's owner and token until
// grant + hold by the database clock: List and a refused acquire say so.
func requireHeldUntil(t *testing.T, b *Backend, l sqllock.Lease, hold time.Duration, what string) {
	t.Helper()
	until := l.BackendTime.Add(hold)
	i := listed(t, b, l.Key)
	require.True(t, i.Held, "%s: List = %+v, want held", what, i)
	require.Equal(t, l.Token, i.Token, what)
	require.Equal(t, l.Owner, i.Owner, what)
	require.False(t, i.Deadline.Before(until), "%s: deadline %v before grant + hold %v", what, i.Deadline, until)
	require.False(t, i.Deadline.After(until.Add(time.Second)), "%s: deadline %v long after grant + hold %v", what, i.Deadline, until)
	_, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: l.Key, TTL: time.Minute, Owner: "intruder"})
	var he *sqllock.HeldError
	require.ErrorAs(t, err, &he, what)
	require.Equal(t, l.Owner, he.Owner, what)
	require.Equal(t, l.Token, he.Token, what)
	require.Greater(t, he.Remaining, 30*time.Minute, what)
}

// The batch statements keep every min-hold rule of the single ones: a
// batched grant with a min hold gets a deadline of at least grant + hold
// (and one without, grant + TTL), a batched release by the holder inside
// the hold keeps the key held by it until then, one without a hold frees
// the key, and a batched forced release (another owner) ends the hold at
// once. The batch answers every member (none is sent again alone).
func TestGroupCommitMinHold(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	coalesceAlways(b)
	const hold = time.Hour
	res := acquireBatch(t, b,
		sqllock.AcquireRequest{Key: "hold", TTL: time.Minute, Owner: "o1", MinHold: hold},
		sqllock.AcquireRequest{Key: "forced", TTL: time.Minute, Owner: "o1", MinHold: hold},
		sqllock.AcquireRequest{Key: "plain", TTL: time.Minute, Owner: "o1"},
	)
	for _, r := range res {
		require.NoError(t, r.err)
	}
	require.Zero(t, b.acquireQ.Alone(), "the batch granted every member")
	held, forced, plain := res[0].l, res[1].l, res[2].l
	requireHeldUntil(t, b, held, hold, "granted in a batch")
	require.Less(t, plain.Deadline.Sub(plain.BackendTime), 2*time.Minute, "a grant without a hold")

	errs := releaseBatch(t, b, held, sqllock.Lease{Key: forced.Key, Token: forced.Token, Owner: "operator"}, plain)
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.Zero(t, b.releaseQ.Alone(), "the batch released every member")
	requireHeldUntil(t, b, held, hold, "released in a batch inside its hold")
	require.False(t, listed(t, b, "forced").Held, "a forced release in a batch ends the hold")
	require.False(t, listed(t, b, "plain").Held, "a release without a hold frees the key")

	// A batched acquire of the key inside its hold is refused, naming the
	// holder; the other keys are granted, with the next tokens.
	res = acquireBatch(t, b,
		sqllock.AcquireRequest{Key: "hold", TTL: time.Minute, Owner: "o2"},
		sqllock.AcquireRequest{Key: "forced", TTL: time.Minute, Owner: "o2"},
		sqllock.AcquireRequest{Key: "plain", TTL: time.Minute, Owner: "o2"},
	)
	var he *sqllock.HeldError
	require.ErrorAs(t, res[0].err, &he)
	require.Equal(t, "o1", he.Owner)
	require.Equal(t, held.Token, he.Token)
	require.NoError(t, res[1].err)
	require.Equal(t, forced.Token+1, res[1].l.Token)
	require.NoError(t, res[2].err)
	require.Equal(t, plain.Token+1, res[2].l.Token)
	// Once the hold is over (forced here by the clock's stand-in, expire),
	// the key is free, with the next token.
	expire(t, b, "hold")
	next := acquireOK(t, b, "hold", "o2", time.Minute)
	require.Equal(t, held.Token+1, next.Token)
}

// TestUpgradeToHoldUntil: a table at migration 00004 (before hold_until)
// with a lease held by the previous release, upgraded while it is held.
// Before 00005 a Backend serves requests without a min hold, alone and in
// batches, and refuses one with a min hold (ErrSchemaMissing, naming the
// fix, nothing written), also when it came in a batch; the migration
// rewrites no row (the table's file stays); after it, the held lease keeps
// its token, holder and deadline, renews, and is released at once (it has
// no min hold), and a grant with a min hold keeps its key held after its
// release.
func TestUpgradeToHoldUntil(t *testing.T) {
	t.Parallel()
	db, upgrade := schemaAt(t, 4)
	ctx := testCtx(t)
	_, err := db.Pool.Exec(ctx, `INSERT INTO sqllock_locks (key, token, held, deadline, owner, value) VALUES
		('a', 7, true, clock_timestamp() + interval '1 hour', 'old-a', 'x')`)
	require.NoError(t, err)

	old, err := New(db.Pool, Options{})
	require.NoError(t, err)
	defer old.Close()
	coalesceAlways(old)
	// The Backend's first calls meet as a batch: on a table below the
	// latest schema version the batch statement (every column) is never
	// sent, and each call goes alone.
	res := acquireBatch(t, old,
		sqllock.AcquireRequest{Key: "h", TTL: time.Minute, Owner: "o", MinHold: time.Hour},
		sqllock.AcquireRequest{Key: "b", TTL: time.Minute, Owner: "o", Value: []byte("v")},
	)
	require.ErrorIs(t, res[0].err, sqllock.ErrSchemaMissing)
	require.Contains(t, res[0].err.Error(), "sqllock migrate up")
	require.Contains(t, res[0].err.Error(), "hold_until")
	require.NoError(t, res[1].err, "a request without a min hold works before the migration")
	require.Equal(t, []byte("v"), res[1].l.Value)
	_, err = old.TryAcquire(ctx, sqllock.AcquireRequest{Key: "h2", TTL: time.Minute, Owner: "o", MinHold: time.Hour})
	require.ErrorIs(t, err, sqllock.ErrSchemaMissing)
	var n int
	require.NoError(t, db.Pool.QueryRow(ctx, `SELECT count(*) FROM sqllock_locks`).Scan(&n))
	require.Equal(t, 2, n, "the refused acquires wrote nothing")
	st := old.stmts.Load()
	require.True(t, st.waited && st.value && !st.hold, "00003's marks and 00004's values are still used")
	require.NoError(t, old.Release(ctx, res[1].l))
	require.False(t, listed(t, old, "b").Held)

	var fileBefore, fileAfter int64
	relfile := `SELECT pg_relation_filenode('sqllock_locks')::bigint`
	require.NoError(t, db.Pool.QueryRow(ctx, relfile).Scan(&fileBefore))
	upgrade()
	require.NoError(t, db.Pool.QueryRow(ctx, relfile).Scan(&fileAfter))
	require.Equal(t, fileBefore, fileAfter, "the migration rewrote the table")

	b, err := New(db.Pool, Options{})
	require.NoError(t, err)
	defer b.Close()
	i := listed(t, b, "a")
	require.True(t, i.Held)
	require.EqualValues(t, 7, i.Token)
	require.Equal(t, "old-a", i.Owner)
	require.Equal(t, []byte("x"), i.Value)
	heldA := sqllock.Lease{Key: "a", Token: 7, Owner: "old-a"}
	r, err := b.TryRenew(ctx, heldA, time.Hour)
	require.NoError(t, err, "the lease held across the upgrade renews")
	require.False(t, r.Deadline.Before(i.Deadline))
	require.NoError(t, b.Release(ctx, heldA))
	require.False(t, listed(t, b, "a").Held, "a lease from before the upgrade has no min hold")
	l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "a", TTL: time.Minute, Owner: "new", MinHold: time.Hour})
	require.NoError(t, err)
	require.EqualValues(t, 8, l.Token)
	require.NoError(t, b.Release(ctx, l))
	requireHeldUntil(t, b, l, time.Hour, "released inside its min hold after the upgrade")
	// The Backend built before the migration keeps its forms without the
	// column until it is rebuilt: requests without a min hold work, and it
	// still refuses one with it rather than ignore it.
	acquireOK(t, old, "c", "o", time.Minute)
	_, err = old.TryAcquire(ctx, sqllock.AcquireRequest{Key: "h3", TTL: time.Minute, Owner: "o", MinHold: time.Hour})
	require.ErrorIs(t, err, sqllock.ErrSchemaMissing)
}

// A refused acquire of a key released inside its min hold keeps the
// refusal's rules: no transaction id (so no row lock, no commit record) and
// no WAL from any node of its plan, alone or in a batch.
func TestMinHoldRefusalWritesNothing(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "hot", TTL: time.Minute, Owner: "holder", MinHold: time.Hour})
	require.NoError(t, err)
	require.NoError(t, b.Release(ctx, l))
	requireHeldUntil(t, b, l, time.Hour, "released inside its hold")

	tx, err := bundle.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	r := txAcquire(t, tx, b.full.acquire, sqllock.AcquireRequest{Key: "hot", TTL: time.Minute, Owner: "w", MinHold: time.Hour})
	require.False(t, r.granted)
	require.True(t, r.held, "reported taken")
	require.Equal(t, "holder", r.owner)
	rows, err := tx.Query(ctx, b.full.acquireBatch, []string{"hot"}, []int64{leaseMicros(time.Minute)}, []string{"w"},
		[][]byte{nil}, []int64{holdMicros(time.Hour)})
	require.NoError(t, err)
	for rows.Next() {
		vals, err := rows.Values()
		require.NoError(t, err)
		require.Equal(t, false, vals[1], "the batch granted a key inside its min hold")
		require.Equal(t, true, vals[4], "the batch reports the key taken")
		require.Equal(t, false, vals[7], "the batch skipped a row it could not grant")
	}
	require.NoError(t, rows.Err())
	var xid *int64
	require.NoError(t, tx.QueryRow(ctx, "SELECT pg_current_xact_id_if_assigned()::text::bigint").Scan(&xid))
	require.Nil(t, xid, "a refused acquire inside a min hold assigned a transaction id")

	records, bytes := planWAL(t, b, b.full.acquire, "hot", int64(60_000_000), "w", nil, holdMicros(time.Hour))
	require.Zero(t, records, "a refused TryAcquire inside a min hold wrote WAL (%d bytes)", bytes)
	records, bytes = planWAL(t, b, b.full.acquireBatch, []string{"hot"}, []int64{60_000_000}, []string{"w"}, [][]byte{nil}, []int64{0})
	require.Zero(t, records, "a refused batch acquire inside a min hold wrote WAL (%d bytes)", bytes)
}
