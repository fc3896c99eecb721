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

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// Tests of the permits' group commit (permit.go, queries/permit_acquire_batch.sql),
// made on purpose as batch_test's are: the queue held, calls queued, then
// let go as one batch.

func permitReq(sem string, n int, owner string) sqllock.PermitRequest {
	return sqllock.PermitRequest{AcquireRequest: sqllock.AcquireRequest{Key: sem, TTL: time.Hour, Owner: owner}, Permits: n}
}

func goPermit(ctx context.Context, b *Backend, req sqllock.PermitRequest) chan acquireResult {
	ch := make(chan acquireResult, 1)
	go func() {
		l, err := b.TryAcquirePermit(ctx, req)
		ch <- acquireResult{l, err}
	}()
	return ch
}

// onEachFlavour runs test in parallel on a Backend of each flavour: the
// pgx pool, and a *sql.DB of each driver.
func onEachFlavour(t *testing.T, test func(t *testing.T, b *Backend)) {
	for _, f := range flavours {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			_, b := f.bundle(t, Options{})
			test(t, b)
		})
	}
}

// requireNoTransactionID fails unless tx has no transaction id yet: what
// it ran locked no row and wrote nothing.
func requireNoTransactionID(t *testing.T, ctx context.Context, tx pgx.Tx, msg string) {
	t.Helper()
	var xid *int64
	require.NoError(t, tx.QueryRow(ctx, "SELECT pg_current_xact_id_if_assigned()::text::bigint").Scan(&xid))
	require.Nil(t, xid, msg)
}

// permitBatch sends reqs as one permit_acquire_batch.sql and returns
// their answers, with how many of them the batch left to be sent alone.
func permitBatch(t *testing.T, b *Backend, reqs ...sqllock.PermitRequest) ([]acquireResult, int64) {
	t.Helper()
	return permitBatchCtx(t, testCtx(t), b, reqs...)
}

func permitBatchCtx(t *testing.T, ctx context.Context, b *Backend, reqs ...sqllock.PermitRequest) ([]acquireResult, int64) {
	t.Helper()
	alone := b.permitQ.Alone()
	res := oneBatch(t, b.permitQ, reqs, func(req sqllock.PermitRequest) chan acquireResult { return goPermit(ctx, b, req) })
	return res, b.permitQ.Alone() - alone
}

// makeSemaphore creates semaphore sem of n permits (its first grant,
// released at once), so that a batch can answer for it.
func makeSemaphore(t *testing.T, b *Backend, sem string, n int) {
	t.Helper()
	require.NoError(t, b.Release(testCtx(t), permitOK(t, b, sem, n, "setup")))
}

// One batch answers what the single statement answers: several requests
// of one semaphore get distinct permits, lowest first, each a new tenure
// (token + 1); an expired permit is free; a held semaphore's refusal
// names its holders; a limit that disagrees with the stored one is
// refused. The grants' tokens and owners are the table's.
func TestPermitBatch(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	ctx := testCtx(t)
	makeSemaphore(t, b, "s", 3)
	permitOK(t, b, "full", 1, "holder")
	makeSemaphore(t, b, "lim", 2)
	old := permitOK(t, b, "exp", 1, "old")
	expire(t, b, old.Key)

	res, alone := permitBatch(t, b,
		permitReq("s", 3, "a"), permitReq("s", 3, "b"), permitReq("full", 1, "c"), permitReq("s", 3, "d"), permitReq("lim", 3, "e"),
		permitReq("exp", 1, "f"))
	require.Zero(t, alone, "the batch answered every request")
	want := map[string]int64{sqllock.PermitKey("s", 1): 2, sqllock.PermitKey("s", 2): 2, sqllock.PermitKey("s", 3): 2}
	for _, i := range []int{0, 1, 3} {
		require.NoError(t, res[i].err, "request %d", i)
		tok, ok := want[res[i].l.Key]
		require.True(t, ok, "request %d got %q, granted twice or not a permit of s", i, res[i].l.Key)
		delete(want, res[i].l.Key)
		require.Equal(t, tok, res[i].l.Token, "a new tenure of a released permit")
	}
	require.Equal(t, sqllock.PermitKey("s", 1), res[0].l.Key, "the first request takes the lowest permit")

	var pe *sqllock.PermitsHeldError
	require.ErrorAs(t, res[2].err, &pe)
	require.Len(t, pe.Holders, 1)
	require.Equal(t, "holder", pe.Holders[0].Owner)
	var le *sqllock.PermitLimitError
	require.ErrorAs(t, res[4].err, &le)
	require.Equal(t, 2, le.Stored)
	require.NoError(t, res[5].err, "an expired permit is free")
	require.Equal(t, old.Key, res[5].l.Key)
	require.Equal(t, old.Token+1, res[5].l.Token, "a new tenure of an expired permit")

	for _, r := range []acquireResult{res[0], res[1], res[3], res[5]} {
		var owner string
		var token int64
		require.NoError(t, b.pool.QueryRow(ctx, "SELECT owner, token FROM "+b.table+" WHERE key = $1 AND held", r.l.Key).Scan(&owner, &token))
		require.Equal(t, r.l.Owner, owner)
		require.Equal(t, r.l.Token, token)
	}
	for _, r := range []acquireResult{res[0], res[1], res[3]} {
		require.NoError(t, b.Release(ctx, r.l))
	}
}

// More requests of a semaphore than it has free permits: the first get
// them, and the one left over is sent again alone, whose refusal names
// every holder, the batch's own included (the batch's snapshot does not
// see them).
func TestPermitBatchLeftOverRefusalNamesBatchHolders(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	makeSemaphore(t, b, "s", 2)
	res, alone := permitBatch(t, b, permitReq("s", 2, "a"), permitReq("s", 2, "b"), permitReq("s", 2, "c"))
	require.NoError(t, res[0].err)
	require.NoError(t, res[1].err)
	require.NotEqual(t, res[0].l.Key, res[1].l.Key)
	var pe *sqllock.PermitsHeldError
	require.ErrorAs(t, res[2].err, &pe)
	owners := []string{}
	for _, h := range pe.Holders {
		owners = append(owners, h.Owner)
	}
	require.ElementsMatch(t, []string{"a", "b"}, owners, "the refusal names the batch's holders")
	require.EqualValues(t, 1, alone, "the left-over request went alone")
}

// A same-owner repeat (an acquire whose reply was lost, sent again while
// others are in flight) gets its own permit back with its token, never a
// second permit; a semaphore not yet created is created by its first
// grant, alone. Both are the single statement's, sent again alone.
func TestPermitBatchRepeatAndFirstUse(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	ctx := testCtx(t)
	makeSemaphore(t, b, "s", 3)
	first := permitOK(t, b, "s", 3, "o")
	res, alone := permitBatch(t, b, permitReq("s", 3, "o"), permitReq("new", 2, "n"), permitReq("s", 3, "p"))
	require.NoError(t, res[0].err)
	require.Equal(t, first.Key, res[0].l.Key, "the repeat took another permit")
	require.Equal(t, first.Token, res[0].l.Token, "the repeat took a new token")
	require.NoError(t, res[1].err)
	require.Equal(t, sqllock.PermitKey("new", 1), res[1].l.Key)
	require.EqualValues(t, 1, res[1].l.Token)
	require.NoError(t, res[2].err)
	require.NotEqual(t, first.Key, res[2].l.Key)
	require.EqualValues(t, 2, alone, "the repeat and the first use went alone")
	var held int
	require.NoError(t, b.pool.QueryRow(ctx, "SELECT count(*) FROM "+b.table+" WHERE key LIKE 's#permit-%' AND held AND owner = 'o'").Scan(&held))
	require.Equal(t, 1, held, "owner o holds one permit")
}

// A permit row another transaction has locked is skipped, not waited for:
// the batch takes the next free one, or, where the locked one was its
// semaphore's only free permit, refuses at once naming no holder (try
// again), as the single statement does.
func TestPermitBatchSkipsLockedRows(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	makeSemaphore(t, b, "two", 2)
	makeSemaphore(t, b, "one", 1)
	tx := holdRows(t, bundle.db.Pool, b.table, "FOR SHARE", sqllock.PermitKey("two", 1), sqllock.PermitKey("one", 1))
	defer tx.Rollback(ctx)
	short, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	res, alone := permitBatchCtx(t, short, b, permitReq("two", 2, "a"), permitReq("one", 1, "b"))
	require.NoError(t, short.Err(), "the batch waited on a locked row")
	require.Zero(t, alone)
	require.NoError(t, res[0].err, "waited on the locked permit row")
	require.Equal(t, sqllock.PermitKey("two", 2), res[0].l.Key)
	var pe *sqllock.PermitsHeldError
	require.ErrorAs(t, res[1].err, &pe)
	require.Empty(t, pe.Holders, "the only free permit is locked: a refusal that names no holder")
}

// A batch of refusals locks no row and writes nothing, as the single
// statement's refusal: it assigns no transaction id.
func TestPermitBatchRefusalWritesNothing(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	permitOK(t, b, "s", 1, "h")
	permitOK(t, b, "t", 1, "h")
	tx, err := bundle.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	rows, err := tx.Query(ctx, b.permit.acquireBatch, []string{"s", "t", "s"}, []int64{60_000_000, 60_000_000, 60_000_000},
		[]string{"a", "b", "c"}, [][]byte{nil, nil, nil}, []int64{1, 1, 1})
	require.NoError(t, err)
	n := 0
	for rows.Next() {
		vals, err := rows.Values()
		require.NoError(t, err)
		require.Empty(t, vals[1], "a held semaphore granted a permit")
		require.Equal(t, false, vals[6], "a refusal sent alone")
		n++
	}
	require.NoError(t, rows.Err())
	require.Equal(t, 3, n)
	requireNoTransactionID(t, ctx, tx, "a batch of refusals locked or wrote a row")
}

// Many goroutines take and give back permits of a few semaphores through
// coalescing: a semaphore never has more holders than its limit (a holder
// counts itself from its grant until just before its release is sent), a
// permit never two, and each permit's tokens strictly increase; on the
// pgx pool and on a *sql.DB of each driver (the arrays as each sends them).
func TestPermitBatchHistory(t *testing.T) {
	t.Parallel()
	onEachFlavour(t, permitBatchHistory)
}

func permitBatchHistory(t *testing.T, b *Backend) {
	coalesceAlways(b)
	ctx := testCtx(t)
	limits := []int{1, 2, 3}
	const workers, pairs = 24, 40
	var (
		mu      sync.Mutex
		holders = map[string]int{}    // semaphore: holders now
		permit  = map[string]string{} // permit key: owner holding it
		last    = map[string]int64{}  // permit key: last token
		grants  atomic.Int64
		wg      sync.WaitGroup
	)
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 3))
			for j := range pairs {
				s := rng.IntN(len(limits))
				sem := fmt.Sprintf("s%d", s)
				owner := fmt.Sprintf("w%d/%d", w, j)
				l, err := b.TryAcquirePermit(ctx, permitReq(sem, limits[s], owner))
				if errors.Is(err, sqllock.ErrNotAcquired) {
					continue
				}
				if err != nil {
					errs <- err
					return
				}
				grants.Add(1)
				mu.Lock()
				holders[sem]++
				bad := ""
				switch {
				case holders[sem] > limits[s]:
					bad = fmt.Sprintf("%s: %d holders, limit %d", sem, holders[sem], limits[s])
				case permit[l.Key] != "":
					bad = fmt.Sprintf("%s granted to %s while %s holds it", l.Key, owner, permit[l.Key])
				case l.Token <= last[l.Key]:
					bad = fmt.Sprintf("%s: token %d granted after token %d", l.Key, l.Token, last[l.Key])
				}
				permit[l.Key], last[l.Key] = owner, l.Token
				mu.Unlock()
				if bad != "" {
					errs <- errors.New(bad)
					return
				}
				mu.Lock()
				holders[sem]--
				permit[l.Key] = ""
				mu.Unlock()
				if err := b.Release(ctx, l); err != nil {
					errs <- fmt.Errorf("release %s token %d: %w", l.Key, l.Token, err)
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
	t.Logf("grants %d, permit batches %d, sent alone %d", grants.Load(), b.permitQ.Batches(), b.permitQ.Alone())
	require.Positive(t, b.permitQ.Batches(), "no permit acquire was coalesced")
	require.Greater(t, grants.Load(), int64(workers*pairs/10), "too few grants to mean anything")
}

// Without other calls in flight a permit acquire is sent at once, alone;
// group commit off never queues one, nor a set.
func TestPermitBatchIdleSendsAlone(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	require.Equal(t, groupCommitInFlight, b.permitQ.Limit, "on by default")
	for i := range 10 {
		require.NoError(t, b.Release(testCtx(t), permitOK(t, b, "s", 2, fmt.Sprint("o", i))))
	}
	require.Zero(t, b.permitQ.Batches())
	off := newBundle(t, Options{DisableGroupCommit: true}).backend
	require.Zero(t, off.permitQ.Limit)
	require.Zero(t, off.setQ.Limit, "DisableGroupCommit turns off the sets' queue too")
}
