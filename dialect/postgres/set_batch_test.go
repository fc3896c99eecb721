package postgres

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// Tests of the sets' group commit (multi.go, queries/acquire_all_batch.sql),
// made on purpose as batch_test's are: the queue held, calls queued, then
// let go as one batch.

type setResult struct {
	ls  []sqllock.Lease
	err error
}

func goSet(ctx context.Context, b *Backend, req sqllock.MultiAcquireRequest) chan setResult {
	ch := make(chan setResult, 1)
	go func() {
		ls, err := b.TryAcquireAll(ctx, req)
		ch <- setResult{ls, err}
	}()
	return ch
}

// setBatch sends reqs as one acquire_all_batch.sql and returns their
// answers, with how many of them the batch left to be sent alone.
func setBatch(t *testing.T, ctx context.Context, b *Backend, reqs ...sqllock.MultiAcquireRequest) ([]setResult, int64) {
	t.Helper()
	alone := b.setQ.Alone()
	res := oneBatch(t, b.setQ, reqs, func(req sqllock.MultiAcquireRequest) chan setResult { return goSet(ctx, b, req) })
	return res, b.setQ.Alone() - alone
}

// rowOf reads key's row: token, held and owner.
func rowOf(t *testing.T, b *Backend, key string) (token int64, held bool, owner string) {
	t.Helper()
	require.NoError(t, b.pool.QueryRow(testCtx(t), "SELECT token, held, owner FROM "+b.table+" WHERE key = $1", key).Scan(&token, &held, &owner))
	return token, held, owner
}

// One batch answers each set as acquire_all would: fresh keys take the
// floor's next token, released and expired keys a new tenure (token + 1),
// a same-owner repeat keeps its tokens and deadlines no earlier, and a set
// with one key held by another owner is refused whole, naming it, its
// other keys untouched. Each set's leases come in its request's order.
func TestSetBatch(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	ctx := testCtx(t)
	require.NoError(t, b.Release(ctx, acquireOK(t, b, "b1", "setup", time.Minute)))
	acquireOK(t, b, "b2", "setup", time.Minute)
	expire(t, b, "b2")
	require.NoError(t, b.Release(ctx, acquireOK(t, b, "c1", "setup", time.Minute)))
	acquireOK(t, b, "held", "holder", time.Hour)
	mine, err := b.TryAcquireAll(ctx, acquireAllReq("d", "d2", "d1"))
	require.NoError(t, err)

	res, alone := setBatch(t, ctx, b,
		acquireAllReq("a", "a2", "a1"), acquireAllReq("b", "b1", "b2"), acquireAllReq("c", "c1", "held"), acquireAllReq("d", "d2", "d1"))
	require.Zero(t, alone, "the batch answered every set")

	require.NoError(t, res[0].err)
	require.Equal(t, []string{"a2", "a1"}, []string{res[0].ls[0].Key, res[0].ls[1].Key}, "leases in the request's order")
	for _, l := range res[0].ls {
		require.EqualValues(t, 1, l.Token, "a fresh key's first token")
		require.Equal(t, "a", l.Owner)
	}
	require.NoError(t, res[1].err)
	for _, l := range res[1].ls {
		require.EqualValues(t, 2, l.Token, "a new tenure of %s", l.Key)
		token, held, owner := rowOf(t, b, l.Key)
		require.Equal(t, l.Token, token)
		require.True(t, held)
		require.Equal(t, "b", owner)
	}

	var he *sqllock.HeldError
	require.ErrorAs(t, res[2].err, &he)
	require.Equal(t, "held", he.Key)
	require.Equal(t, "holder", he.Owner)
	token, held, _ := rowOf(t, b, "c1")
	require.EqualValues(t, 1, token, "a refused set wrote its free key")
	require.False(t, held, "a refused set took its free key")

	require.NoError(t, res[3].err, "the same owner's repeat is granted")
	for i, l := range res[3].ls {
		require.Equal(t, mine[i].Key, l.Key)
		require.Equal(t, mine[i].Token, l.Token, "the repeat took a new token")
		require.False(t, l.Deadline.Before(mine[i].Deadline), "the repeat moved the deadline back")
	}
}

// A row another transaction has locked refuses its set at once, naming
// the key without an owner (try again), and the set's other key is
// neither granted nor left half-granted; the batch's other set is
// granted.
func TestSetBatchSkipsLockedRow(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	for _, k := range []string{"e1", "e2", "f1"} {
		require.NoError(t, b.Release(ctx, acquireOK(t, b, k, "setup", time.Minute)))
	}
	tx := holdRows(t, bundle.db.Pool, b.table, "FOR SHARE", "e2")
	defer tx.Rollback(ctx)
	short, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	res, alone := setBatch(t, short, b, acquireAllReq("e", "e1", "e2"), acquireAllReq("f", "f1"))
	require.NoError(t, short.Err(), "the batch waited on a locked row")
	require.Zero(t, alone)
	var he *sqllock.HeldError
	require.ErrorAs(t, res[0].err, &he)
	require.Equal(t, "e2", he.Key)
	require.Empty(t, he.Owner)
	_, held, _ := rowOf(t, b, "e1")
	require.False(t, held, "half of a refused set was granted")
	require.NoError(t, res[1].err)
}

// A fresh key that another transaction inserts first fails the batch's
// statement whole (a unique violation): every set is then sent alone and
// gets acquire_all's answer, the other sets granted, the clashing one
// refused naming the key, and nothing of the failed statement stays.
func TestSetBatchFreshKeyInsertedMeanwhile(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	tx, err := bundle.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	_, err = tx.Exec(ctx, "INSERT INTO "+b.table+" (key, token, held, deadline, owner) VALUES ('x', 1, true, clock_timestamp() + interval '1 hour', 'other')")
	require.NoError(t, err)

	holdQueue(b.setQ)
	xy := goSet(ctx, b, acquireAllReq("w", "y", "x"))
	waitQueued(t, b.setQ, 1)
	z := goSet(ctx, b, acquireAllReq("v", "z"))
	waitQueued(t, b.setQ, 2)
	flushQueue(b.setQ)
	waitForLockWait(t, bundle.db.Pool, tx)
	require.NoError(t, tx.Commit(ctx))

	rxy, rz := recv(t, xy), recv(t, z)
	unholdQueue(t, b.setQ)
	require.EqualValues(t, 1, b.setQ.Batches())
	require.EqualValues(t, 2, b.setQ.Alone(), "both sets went alone after the refused batch")
	var he *sqllock.HeldError
	require.ErrorAs(t, rxy.err, &he)
	require.Equal(t, "x", he.Key)
	require.NoError(t, rz.err)
	var y int
	require.NoError(t, b.pool.QueryRow(ctx, "SELECT count(*) FROM "+b.table+" WHERE key = 'y'").Scan(&y))
	require.Zero(t, y, "the failed batch left its insert of y")
}

// A batch of refused sets locks no row and writes nothing: it assigns no
// transaction id.
func TestSetBatchRefusalWritesNothing(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	acquireOK(t, b, "h1", "holder", time.Hour)
	acquireOK(t, b, "h2", "holder", time.Hour)
	require.NoError(t, b.Release(ctx, acquireOK(t, b, "free", "setup", time.Minute)))
	tx, err := bundle.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	rows, err := tx.Query(ctx, b.full.acquireAllBatch, []string{"free", "h1", "h2", "new"}, []int64{1, 1, 2, 2},
		[]int64{60_000_000, 60_000_000}, []string{"a", "b"}, [][]byte{nil, nil})
	require.NoError(t, err)
	n := 0
	for rows.Next() {
		vals, err := rows.Values()
		require.NoError(t, err)
		require.Equal(t, false, vals[2], "a set with a held key granted %v", vals[1])
		n++
	}
	require.NoError(t, rows.Err())
	require.Equal(t, 4, n)
	requireNoTransactionID(t, ctx, tx, "a batch of refused sets locked or wrote a row")
}

// Many goroutines take overlapping sets of a few keys through coalescing:
// a set is granted whole or not at all, no key ever has two holders (a
// holder marks its keys in memory from its grant until just before its
// release is sent), and each key's tokens strictly increase; on the pgx
// pool and on a *sql.DB of each driver (the arrays as each sends them).
func TestSetBatchHistory(t *testing.T) {
	t.Parallel()
	onEachFlavour(t, setBatchHistory)
}

func setBatchHistory(t *testing.T, b *Backend) {
	coalesceAlways(b)
	ctx := testCtx(t)
	const keys, workers, sets = 10, 24, 40
	var (
		mu     sync.Mutex
		holder = map[string]string{}
		last   = map[string]int64{}
		grants atomic.Int64
		wg     sync.WaitGroup
	)
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 4))
			for j := range sets {
				perm := rng.Perm(keys)[:1+rng.IntN(3)]
				req := sqllock.MultiAcquireRequest{TTL: time.Minute, Owner: fmt.Sprintf("w%d/%d", w, j)}
				for _, k := range perm {
					req.Keys = append(req.Keys, fmt.Sprint("k", k))
				}
				ls, err := b.TryAcquireAll(ctx, req)
				if errors.Is(err, sqllock.ErrNotAcquired) {
					continue
				}
				if err != nil {
					errs <- err
					return
				}
				grants.Add(1)
				mu.Lock()
				bad := ""
				if len(ls) != len(req.Keys) {
					bad = fmt.Sprintf("%s: %d leases for %d keys", req.Owner, len(ls), len(req.Keys))
				}
				for _, l := range ls {
					switch {
					case holder[l.Key] != "":
						bad = fmt.Sprintf("%s granted to %s while %s holds it", l.Key, req.Owner, holder[l.Key])
					case l.Token <= last[l.Key]:
						bad = fmt.Sprintf("%s: token %d granted after token %d", l.Key, l.Token, last[l.Key])
					}
					holder[l.Key], last[l.Key] = req.Owner, l.Token
				}
				mu.Unlock()
				if bad != "" {
					errs <- errors.New(bad)
					return
				}
				mu.Lock()
				for _, l := range ls {
					holder[l.Key] = ""
				}
				mu.Unlock()
				out, err := b.ReleaseAll(ctx, ls)
				if err == nil {
					err = errors.Join(out...)
				}
				if err != nil {
					errs <- fmt.Errorf("release %s: %w", req.Owner, err)
					return
				}
			}
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}
	t.Logf("grants %d, set batches %d, sent alone %d", grants.Load(), b.setQ.Batches(), b.setQ.Alone())
	require.Positive(t, b.setQ.Batches(), "no set was coalesced")
	// Enough grants for the history to mean something. Overlapping sets
	// refuse one another often, and more so on a loaded machine: 81 of
	// the attempts were granted in one run beside other test packages.
	require.Greater(t, grants.Load(), int64(workers*sets/20))
}

// A batch's grants commit synchronously whatever the session's
// synchronous_commit, by the insert arm (fresh keys) and by the update arm
// (released keys) alike.
func TestSetBatchGrantIsDurable(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	require.NoError(t, b.Release(ctx, acquireOK(t, b, "old1", "o", time.Minute)))
	require.NoError(t, b.Release(ctx, acquireOK(t, b, "old2", "o", time.Minute)))
	for _, keys := range [][]string{{"new1", "new2"}, {"old1", "old2"}} {
		tx, err := bundle.db.Pool.Begin(ctx)
		require.NoError(t, err)
		t.Cleanup(func() { _ = tx.Rollback(context.Background()) }) // a failure leaves no row locked
		_, err = tx.Exec(ctx, "SET LOCAL synchronous_commit = off")
		require.NoError(t, err)
		rows, err := tx.Query(ctx, b.full.acquireAllBatch, keys, []int64{1, 2}, []int64{60_000_000, 60_000_000}, []string{"a", "b"}, [][]byte{nil, nil})
		require.NoError(t, err)
		granted := 0
		for rows.Next() {
			vals, err := rows.Values()
			require.NoError(t, err)
			if vals[2] == true {
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

// While the releases are busy, ReleaseAll's leases join the releases'
// group commit (one batch here, with a single Release of another lease)
// rather than sending a statement of their own; each gets Release's
// answer.
func TestReleaseAllJoinsGroupCommitWhenBusy(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	ctx := testCtx(t)
	set, err := b.TryAcquireAll(ctx, acquireAllReq("o", "r1", "r2", "r3"))
	require.NoError(t, err)
	other := acquireOK(t, b, "r4", "p", time.Minute)
	lost := set[2]
	expire(t, b, lost.Key)
	require.NoError(t, b.Release(ctx, acquireOK(t, b, lost.Key, "q", time.Minute)))

	holdQueue(b.releaseQ)
	all := make(chan []error, 1)
	go func() {
		out, err := b.ReleaseAll(ctx, set)
		require.NoError(t, err)
		all <- out
	}()
	waitQueued(t, b.releaseQ, 3)
	single := goRelease(ctx, b, other)
	waitQueued(t, b.releaseQ, 4)
	flushQueue(b.releaseQ)
	out := recv(t, all)
	require.NoError(t, recv(t, single))
	unholdQueue(t, b.releaseQ)
	require.EqualValues(t, 1, b.releaseQ.Batches(), "the set's leases and the single release went as one batch")
	require.NoError(t, out[0])
	require.NoError(t, out[1])
	var le *sqllock.LostError
	require.ErrorAs(t, out[2], &le, "a lease taken over meanwhile is lost, as Release says")
	for _, k := range []string{"r1", "r2", "r4"} {
		_, held, _ := rowOf(t, b, k)
		require.False(t, held, "%s still held", k)
	}
}
