package integration

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/faultproxy"
	"github.com/ashlock/ashlock/sqllock"
)

// protectedSQL is a protected resource in the database: a counter that
// applies a write only with a token at least its fence, and logs every
// attempt that executed, applied or not.
const protectedSQL = `
CREATE TABLE protected (k text PRIMARY KEY, val bigint NOT NULL, fence bigint NOT NULL);
CREATE TABLE protected_attempts (id bigserial PRIMARY KEY, k text NOT NULL, token bigint NOT NULL, applied boolean NOT NULL,
    app text NOT NULL DEFAULT current_setting('application_name'), at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE lock_statements (id bigserial PRIMARY KEY, kind text NOT NULL,
    app text NOT NULL DEFAULT current_setting('application_name'), at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE FUNCTION lock_statement() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO lock_statements (kind) VALUES (CASE WHEN current_query() LIKE '%AS renewed%' THEN 'renew'
        WHEN current_query() LIKE '%AS granted%' THEN 'acquire' WHEN current_query() LIKE '%AS released%' THEN 'release' ELSE 'other' END);
    RETURN NULL;
END $$;
CREATE TRIGGER lock_statement AFTER UPDATE ON sqllock_locks FOR EACH STATEMENT EXECUTE FUNCTION lock_statement();`

const protectedWriteSQL = `
WITH w AS (UPDATE protected SET val = val + 1, fence = $2 WHERE k = $1 AND fence <= $2 RETURNING k)
INSERT INTO protected_attempts (k, token, applied) SELECT $1, $2, EXISTS (SELECT FROM w)`

func protectedWrite(ctx context.Context, pool *pgxpool.Pool, key string, token int64) error {
	_, err := pool.Exec(ctx, protectedWriteSQL, key, token)
	return err
}

// TestRobustPartitionHolderDelayedPackets is PG-1b: the holder A's
// connection holds its bytes for TTL+1s and then delivers them: a renewal and
// a protected write reach the database after B took the key. The write is
// refused by the fence; the renewal, which A gave up on at its local
// deadline, touches no row when it runs (its statement trigger counts it;
// pgx's cancel request for it may also win the race and abort it), the
// audit log has no row version of A's token after B's grant, and B's lease
// is untouched.
func TestRobustPartitionHolderDelayedPackets(t *testing.T) {
	t.Parallel()
	const key = "pg1b"
	w := newRobustWorld(t, "PG-1b", 0, robustTTL, robustParams)
	ctx, cancel := context.WithTimeout(t.Context(), 40*time.Second)
	defer cancel()
	_, err := w.db.Pool.Exec(ctx, protectedSQL)
	require.NoError(t, err)
	_, err = w.db.Pool.Exec(ctx, "INSERT INTO protected VALUES ($1, 0, 0)", key)
	require.NoError(t, err)
	// One connection for A's leases, so that its renewal statement is
	// prepared on it before the hold and the held bytes are the whole
	// execution; A's protected writes go through a pool of their own on
	// the same route.
	a, b := w.clientConns(true, 1, nil, robustOpts()), w.client(false, robustOpts())
	aWrites := a.extraPool(t)

	ga, _, err := w.hold(ctx, a, key, 0, true)
	require.NoError(t, err)
	require.NoError(t, protectedWrite(ctx, aWrites, key, ga.Token()))
	pause(ctx, 700*time.Millisecond) // a renewal or two
	require.NoError(t, ga.Err())

	holdAt := time.Now()
	a.proxy.Set(faultproxy.Hold)
	// A's protected write waits without a deadline of its own (so pgx
	// sends no cancel request that could race the delayed statement).
	writeDone := make(chan error, 1)
	go func() { writeDone <- protectedWrite(ctx, aWrites, key, ga.Token()) }()
	select {
	case <-ga.Done():
	case <-ctx.Done():
		t.Fatal("A's guard was never cancelled")
	}
	gb, _ := w.tryUntil(ctx, b, key, 2*w.ttl)
	require.NoError(t, protectedWrite(ctx, b.pool, key, gb.Token()))
	grantedB := time.Now()

	pause(ctx, time.Until(holdAt.Add(w.ttl+time.Second)))
	require.Positive(t, a.proxy.Stats().Queued, "nothing was held")
	a.proxy.Pass()
	// Wait until the held bytes are delivered and the database is done
	// with A's abandoned connections.
	require.NoError(t, <-writeDone, "the delayed write runs once delivered")
	robustEventually(t, 20*time.Second, func() bool { s := a.proxy.Stats(); return s.Queued == 0 && s.Open <= 1 },
		"A's held connections were not delivered and closed")

	var renewsAfter, writesAfter, writesApplied int
	require.NoError(t, w.db.Pool.QueryRow(ctx, `SELECT count(*) FROM lock_statements WHERE app = $1 AND kind = 'renew' AND at > $2`,
		a.app, grantedB).Scan(&renewsAfter))
	require.NoError(t, w.db.Pool.QueryRow(ctx, `SELECT count(*), count(*) FILTER (WHERE applied) FROM protected_attempts WHERE app = $1 AND at > $2`,
		a.app, grantedB).Scan(&writesAfter, &writesApplied))
	var fence int64
	require.NoError(t, w.db.Pool.QueryRow(ctx, "SELECT fence FROM protected WHERE k = $1", key).Scan(&fence))
	require.Equal(t, gb.Token(), fence)
	require.Zero(t, writesApplied, "a delayed stale write was applied")
	require.NoError(t, gb.Err())
	require.NoError(t, gb.Release(ctx))
	require.ErrorIs(t, ga.Release(ctx), sqllock.ErrLeaseLost)

	h, r := w.check(ctx, "go test ./integration -run '^TestRobustPartitionHolderDelayedPackets$' -v")
	// The audit log: after B's grant, no row version of A's token.
	grantB := grantOf(t, h, key, gb.Token())
	for _, au := range h.Audit {
		if au.Seq > grantB.Seq {
			require.Equal(t, gb.Token(), au.Token, "a row version of token %d after B's grant: %+v", au.Token, au)
		}
	}
	delivered := renewsAfter + writesAfter
	require.Equal(t, 1, writesAfter, "the delayed write ran after B's grant")
	faults := map[string]int{"hold": 1, "delayed_statements_delivered": delivered}
	t.Log(w.figures("TestRobustPartitionHolderDelayedPackets", h, r, faults,
		fmt.Sprintf("delayed_renews_run=%d delayed_writes_run=%d delayed_writes_applied=%d rows_affected_by_delayed=0 held_bytes=%d",
			renewsAfter, writesAfter, writesApplied, a.proxy.Stats().Delivered)))
	robustRequireFired(t, faults)
}
