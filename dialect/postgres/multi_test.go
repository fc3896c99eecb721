package postgres

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

func acquireAllReq(owner string, keys ...string) sqllock.MultiAcquireRequest {
	return sqllock.MultiAcquireRequest{Keys: keys, TTL: time.Minute, Owner: owner}
}

// A set refused by a key the snapshot shows held locks no row, takes no
// transaction id and writes no WAL, however many of its keys are fresh,
// released or expired; a grant writes (the control).
func TestMultiRefusalWritesNothing(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	acquireOK(t, b, "held", "holder", time.Hour)
	require.NoError(t, b.Release(ctx, acquireOK(t, b, "released", "o", time.Hour)))
	acquireOK(t, b, "expired", "o", time.Hour)
	expire(t, b, "expired")
	keys, err := json.Marshal([]string{"expired", "fresh", "held", "released"})
	require.NoError(t, err)
	args := []any{string(keys), int64(60_000_000), "waiter", nil}

	tx, err := bundle.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	rows, err := tx.Query(ctx, b.full.acquireAll, args...)
	require.NoError(t, err)
	n := 0
	for rows.Next() {
		n++
	}
	require.NoError(t, rows.Err())
	require.Equal(t, 4, n)
	var xid *int64
	require.NoError(t, tx.QueryRow(ctx, "SELECT pg_current_xact_id_if_assigned()::text::bigint").Scan(&xid))
	require.Nil(t, xid, "a refused TryAcquireAll assigned a transaction id")
	var locked int
	require.NoError(t, tx.QueryRow(ctx, "SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid' AND pid = pg_backend_pid()").Scan(&locked))
	require.Zero(t, locked)
	require.NoError(t, tx.Rollback(ctx))

	records, bytes := planWAL(t, b, b.full.acquireAll, args...)
	require.Zero(t, records, "a refused TryAcquireAll wrote WAL (%d bytes)", bytes)
	free, err := json.Marshal([]string{"expired", "fresh", "released"})
	require.NoError(t, err)
	records, _ = planWAL(t, b, b.full.acquireAll, string(free), int64(60_000_000), "w", nil)
	require.Positive(t, records, "control: a granting TryAcquireAll should write WAL")
}

// A free row of the set that another transaction holds locked refuses the
// set at once, naming that key without an owner: never waited for. The
// set's other keys are left as they were, and once the lock is gone the
// set is granted.
func TestMultiSkipsLockedRow(t *testing.T) {
	t.Parallel()
	for _, f := range flavours {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			bundle, b := f.bundle(t, Options{})
			ctx := testCtx(t)
			require.NoError(t, b.Release(ctx, acquireOK(t, b, "b", "o", time.Minute)))
			c := acquireOK(t, b, "c", "o", time.Minute)
			require.NoError(t, b.Release(ctx, c))
			tx := holdRows(t, bundle.db.Pool, b.table, "FOR UPDATE", "b")

			actx, cancel := context.WithTimeout(ctx, 5*time.Second)
			defer cancel()
			_, err := b.TryAcquireAll(actx, acquireAllReq("w", "c", "b", "a"))
			var he *sqllock.HeldError
			require.ErrorAs(t, err, &he, "the set waited for the locked row")
			require.Equal(t, "b", he.Key)
			require.Empty(t, he.Owner)
			list, err := b.List(ctx, "")
			require.NoError(t, err)
			require.Len(t, list, 2, "a fresh key got a row: %+v", list)
			for _, i := range list {
				require.False(t, i.Held, "%s held after a refusal", i.Key)
			}

			require.NoError(t, tx.Rollback(ctx))
			ls, err := b.TryAcquireAll(ctx, acquireAllReq("w", "c", "b", "a"))
			require.NoError(t, err)
			require.Greater(t, ls[0].Token, c.Token)
		})
	}
}

// A fresh key of the set that another transaction inserts first (seen by
// neither the snapshot nor the locks) fails the whole statement: the
// set's other fresh keys, inserted before it, are rolled back with it,
// and the refusal names the key.
func TestMultiFreshKeyInsertedMeanwhile(t *testing.T) {
	t.Parallel()
	for _, f := range flavours {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			bundle, b := f.bundle(t, Options{})
			ctx := testCtx(t)
			tx, err := bundle.db.Pool.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx)
			_, err = tx.Exec(ctx, "INSERT INTO "+b.table+" (key, token, held, deadline, owner) VALUES ('b', 1, true, clock_timestamp() + interval '1 hour', 'other')")
			require.NoError(t, err)

			done := make(chan error, 1)
			go func() {
				_, err := b.TryAcquireAll(ctx, acquireAllReq("w", "c", "b", "a"))
				done <- err
			}()
			waitForLockWait(t, bundle.db.Pool, tx)
			require.NoError(t, tx.Commit(ctx))
			err = <-done
			var he *sqllock.HeldError
			require.ErrorAs(t, err, &he)
			require.Equal(t, "b", he.Key)
			list, err := b.List(ctx, "")
			require.NoError(t, err)
			require.Len(t, list, 1, "the statement left a row of its own: %+v", list)
			require.Equal(t, "other", list[0].Owner)
		})
	}
}

// waitForLockWait returns once a session waits for tx's transaction (an
// insert of the same key waits for it to end).
func waitForLockWait(t *testing.T, pool interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, tx pgx.Tx) {
	t.Helper()
	pid := tx.Conn().PgConn().PID()
	deadline := time.Now().Add(20 * time.Second)
	for {
		var n int
		require.NoError(t, pool.QueryRow(testCtx(t), "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))", pid).Scan(&n))
		if n > 0 {
			return
		}
		require.True(t, time.Now().Before(deadline), "no session came to wait for the inserting transaction")
		time.Sleep(5 * time.Millisecond)
	}
}

// The statement itself inserts fresh keys in key order, whatever the
// order it is given them in, so two sets of the same fresh keys in
// opposite orders never deadlock. A third transaction's uncommitted insert
// of the middle key holds both statements inside their inserts until it
// rolls back: inserting in the given order, each would then hold a key
// the other waits for (a deadlock, 40P01, which the Backend would hide by
// sending the statement again); in key order the second waits for the
// first's first key and loses the race for it (23505).
func TestMultiOppositeOrdersNeverDeadlock(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	for round := range 3 {
		x, y, z := fmt.Sprintf("r%d-x", round), fmt.Sprintf("r%d-y", round), fmt.Sprintf("r%d-z", round)
		blocker, err := bundle.db.Pool.Begin(ctx)
		require.NoError(t, err)
		_, err = blocker.Exec(ctx, "INSERT INTO "+b.table+" (key, token, held, deadline, owner) VALUES ($1, 1, true, clock_timestamp(), 'blocker')", y)
		require.NoError(t, err)
		var wg sync.WaitGroup
		errs := make([]error, 2)
		pids := make(chan uint32, 2)
		for i, order := range [][]string{{x, y, z}, {z, y, x}} {
			keys, err := json.Marshal(order)
			require.NoError(t, err)
			conn, err := b.pool.Acquire(ctx)
			require.NoError(t, err)
			pids <- conn.Conn().PgConn().PID()
			wg.Go(func() {
				defer conn.Release()
				rows, err := conn.Query(ctx, b.full.acquireAll, string(keys), int64(60_000_000), fmt.Sprint("o", i), nil)
				if err == nil {
					for rows.Next() {
					}
					err = rows.Err()
				}
				errs[i] = err
			})
		}
		close(pids)
		var ids []uint32
		for p := range pids {
			ids = append(ids, p)
		}
		deadline := time.Now().Add(20 * time.Second)
		for {
			var n int
			require.NoError(t, bundle.db.Pool.QueryRow(ctx,
				"SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1) AND cardinality(pg_blocking_pids(pid)) > 0", ids).Scan(&n))
			if n == 2 {
				break
			}
			require.True(t, time.Now().Before(deadline), "round %d: the two statements never both waited", round)
			time.Sleep(5 * time.Millisecond)
		}
		require.NoError(t, blocker.Rollback(ctx))
		wg.Wait()
		for _, err := range errs {
			if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok && pgErr.Code == "23505" {
				continue // lost the race for a fresh key: refused, rolled back
			}
			require.NoError(t, err, "round %d", round)
		}
	}
}

// A set's grant commits synchronously whatever the session's
// synchronous_commit, by the insert arm (fresh keys) and by the update arm
// (released keys) alike.
func TestMultiGrantIsDurable(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	require.NoError(t, b.Release(ctx, acquireOK(t, b, "old1", "o", time.Minute)))
	require.NoError(t, b.Release(ctx, acquireOK(t, b, "old2", "o", time.Minute)))
	for _, keys := range [][]string{{"new1", "new2"}, {"old1", "old2"}} {
		arg, err := json.Marshal(keys)
		require.NoError(t, err)
		tx, err := bundle.db.Pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) }) // a failure leaves no row locked
		_, err = tx.Exec(ctx, "SET LOCAL synchronous_commit = off")
		require.NoError(t, err)
		rows, err := tx.Query(ctx, b.full.acquireAll, string(arg), int64(60_000_000), "w", nil)
		require.NoError(t, err)
		granted := 0
		for rows.Next() {
			var (
				key           string
				ok, held, g   bool
				unlocked      bool
				token         int64
				deadline, now time.Time
				owner         string
				value         []byte
				shared        int
			)
			require.NoError(t, rows.Scan(&key, &ok, &token, &deadline, &held, &owner, &now, &g, &unlocked, &value, &shared))
			if ok {
				granted++
			}
		}
		require.NoError(t, rows.Err())
		require.Equal(t, len(keys), granted)
		var s string
		require.NoError(t, tx.QueryRow(ctx, "SHOW synchronous_commit").Scan(&s))
		require.Equal(t, "on", s, "the grant of %q must commit synchronously", keys)
		require.NoError(t, tx.Commit(ctx))
	}
}

// The statement finds the set's rows by the primary key, whatever the
// table's size: no node of its plan scans the lock table (a join with
// the key list did, three times: the planner takes the JSON array for
// 100 rows).
func TestMultiFindsRowsByIndex(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	_, err := bundle.db.Pool.Exec(ctx, "INSERT INTO "+b.table+" (key, token, held, deadline, owner) SELECT 'k' || g, 1, false, clock_timestamp(), 'fill' FROM generate_series(1, 5000) AS g")
	require.NoError(t, err)
	_, err = bundle.db.Pool.Exec(ctx, "ANALYZE "+b.table)
	require.NoError(t, err)
	var plan []map[string]any
	require.NoError(t, b.pool.QueryRow(ctx, "EXPLAIN (FORMAT JSON) "+b.full.acquireAll, `["k1","k20","k300","new"]`, int64(60_000_000), "w", nil).Scan(&plan))
	require.Empty(t, tableScans(t, plan), "the statement scans the lock table")
}

// TestSetStatementsFindRowsByIndex: the statements of a set (its
// acquire, and the release of a set or of the group commit's batch of
// single releases) and a permit's acquire (which reads its semaphore's
// N permit rows) find their rows through the key's index in the plan
// the server keeps for them (the generic plan of a prepared statement,
// made once per connection), also where that plan was made on a young
// table (no statistics yet, a few rows): a plan made there that joins
// the table with the key list, or filters it by key = ANY (array), is a
// scan of the whole table, which stays, at every size, until the next
// ANALYZE (2 ms a set at 7,000 keys, docs/multi-key.md#what-it-costs).
// The single acquire is the control: it scans too in a plan made on a
// table of a few hundred keys (a page or two), not on the states here.
func TestSetStatementsFindRowsByIndex(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name, args string
		statement  func(b *Backend) string
	}{
		{"acquire_all", `'["k7","k14","k21","new"]', 60000000, 'w', NULL`, func(b *Backend) string { return b.full.acquireAll }},
		{"release_batch", `ARRAY['k7','k14','k21','new'], ARRAY[1,1,1,1]::bigint[], ARRAY['fill','fill','fill','w']`, func(b *Backend) string { return b.full.releaseBatch }},
		{"acquire", `'k7', 60000000, 'w', NULL, 0`, func(b *Backend) string { return b.full.acquire }},
		{"permit_acquire", `'k', 60000000, 'w', NULL, 4`, func(b *Backend) string { return b.permit.acquire }},
		{"acquire_all_batch", `ARRAY['k7','k14','k21','new'], ARRAY[1,1,2,2]::bigint[], ARRAY[60000000,60000000]::bigint[], ARRAY['w','v'], ARRAY[NULL,NULL]::bytea[]`,
			func(b *Backend) string { return b.full.acquireAllBatch }},
		{"permit_acquire_batch", `ARRAY['k','j','k'], ARRAY[60000000,60000000,60000000]::bigint[], ARRAY['w','w','v'], ARRAY[NULL,NULL,NULL]::bytea[], ARRAY[4,4,4]`,
			func(b *Backend) string { return b.permit.acquireBatch }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			requireIndexedPlans(t, tc.statement, tc.args)
		})
	}
}

// requireIndexedPlans checks that the generic plans of the statement
// that statement picks from a Backend, made on an empty table, on one
// that grew to 1,000 and 5,000 keys, and after an ANALYZE of each, read
// the lock table by its key's index only (args: EXECUTE's arguments).
func requireIndexedPlans(t *testing.T, statement func(b *Backend) string, args string) {
	t.Helper()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	c, err := bundle.db.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer c.Release()
	defer func() { _, _ = c.Exec(context.WithoutCancel(ctx), "DISCARD ALL") }()
	_, err = c.Exec(ctx, "SET plan_cache_mode = force_generic_plan")
	require.NoError(t, err)
	_, err = c.Exec(ctx, "PREPARE set_stmt AS "+statement(b))
	require.NoError(t, err)
	explain := func() []string {
		var plan []map[string]any
		require.NoError(t, c.QueryRow(ctx, "EXPLAIN (FORMAT JSON) EXECUTE set_stmt("+args+")").Scan(&plan))
		return tableScans(t, plan)
	}
	// The plan made on the table as the first statement finds it
	// (empty, never analyzed), kept as keys come; and the plans
	// made after an ANALYZE of a small table, kept as it grows.
	require.Empty(t, explain(), "the generic plan made on an empty table scans the lock table")
	have := 0
	for _, n := range []int{1000, 5000} {
		_, err = bundle.db.Pool.Exec(ctx, "INSERT INTO "+b.table+" (key, token, held, deadline, owner) SELECT 'k' || g, 1, g % 7 = 0, clock_timestamp(), 'fill' FROM generate_series($1::int, $2::int) AS g", have+1, n)
		require.NoError(t, err)
		have = n
		require.Empty(t, explain(), "the generic plan made before %d keys came scans the lock table", n)
		_, err = bundle.db.Pool.Exec(ctx, "ANALYZE "+b.table)
		require.NoError(t, err)
		require.Empty(t, explain(), "the generic plan made on %d analyzed keys scans the lock table", n)
	}
}

// tableScans is the tables that an EXPLAIN (FORMAT JSON) plan reads by a
// sequential scan, but for the token floor: a sequence (one row, read
// for a first row's token), not the lock table.
func tableScans(t *testing.T, plan []map[string]any) []string {
	t.Helper()
	var scans []string
	var walk func(node map[string]any)
	walk = func(node map[string]any) {
		if node["Node Type"] == "Seq Scan" && !strings.HasSuffix(fmt.Sprint(node["Relation Name"]), "_floor") {
			scans = append(scans, fmt.Sprint(node["Relation Name"]))
		}
		children, _ := node["Plans"].([]any)
		for _, c := range children {
			walk(c.(map[string]any))
		}
	}
	require.Len(t, plan, 1)
	walk(plan[0]["Plan"].(map[string]any))
	return scans
}

// ReleaseAll does not stall on a row another transaction locks (as
// FencedTx holds its lease's row FOR SHARE): the set's other leases are
// released by the one statement at once, and the locked one is released
// alone afterwards, waiting for its row as Release does.
func TestReleaseAllLockedRowDoesNotStall(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	ls := []sqllock.Lease{acquireOK(t, b, "c", "o", time.Minute), acquireOK(t, b, "b", "o", time.Minute), acquireOK(t, b, "a", "o", time.Minute)}
	tx := holdRows(t, bundle.db.Pool, b.table, "FOR SHARE", "b")
	type result struct {
		answers []error
		err     error
	}
	done := make(chan result, 1)
	go func() {
		answers, err := b.ReleaseAll(ctx, ls)
		done <- result{answers, err}
	}()
	heldNow := func(key string) bool {
		infos, err := b.List(ctx, key)
		require.NoError(t, err)
		return len(infos) == 1 && infos[0].Held
	}
	require.Eventually(t, func() bool { return !heldNow("a") && !heldNow("c") }, 10*time.Second, 5*time.Millisecond,
		"the free leases of the set were not released while another row was locked")
	require.Empty(t, done, "the locked lease was answered while its row was locked")
	require.True(t, heldNow("b"))
	require.NoError(t, tx.Commit(ctx))
	r := recv(t, done)
	require.NoError(t, r.err)
	require.Equal(t, []error{nil, nil, nil}, r.answers)
	require.False(t, heldNow("b"))
}
