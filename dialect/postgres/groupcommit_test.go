package postgres

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/groupcommit"
	"github.com/ashlock/ashlock/internal/testkit/pgtest"
	"github.com/ashlock/ashlock/sqllock"
	"github.com/ashlock/ashlock/sqllock/backendtest"
)

// Tests of the client-side group commit (batch.go). To make a batch
// on purpose, a test fills a queue's statements in flight (holdQueue), so
// that calls queue, waits for them to be queued, and lets the queue go as
// one batch (flushQueue), as the end of a statement in flight would.

// coalesceAlways makes b coalesce every call that arrives while one
// statement of its kind is in flight.
func coalesceAlways(b *Backend) {
	b.acquireQ.Limit, b.releaseQ.Limit, b.permitQ.Limit, b.setQ.Limit = 1, 1, 1, 1
}

func holdQueue[Req, Res any](q *groupcommit.Queue[Req, Res]) { q.Hold() }

// waitQueued waits until n calls are queued in q.
func waitQueued[Req, Res any](t *testing.T, q *groupcommit.Queue[Req, Res], n int) {
	t.Helper()
	require.Eventually(t, func() bool { return q.Queued() == n }, 10*time.Second, time.Millisecond, "calls queued")
}

// flushQueue ends one held statement: the queue goes as batches.
func flushQueue[Req, Res any](q *groupcommit.Queue[Req, Res]) { q.Flush() }

// unholdQueue waits for the batches to end and frees the held statements.
func unholdQueue[Req, Res any](t *testing.T, q *groupcommit.Queue[Req, Res]) {
	t.Helper()
	require.Eventually(t, q.Unhold, 10*time.Second, time.Millisecond)
}

type acquireResult struct {
	l   sqllock.Lease
	err error
}

func goAcquire(ctx context.Context, b *Backend, key, owner string) chan acquireResult {
	ch := make(chan acquireResult, 1)
	go func() {
		l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: owner})
		ch <- acquireResult{l, err}
	}()
	return ch
}

func goRelease(ctx context.Context, b *Backend, l sqllock.Lease) chan error {
	ch := make(chan error, 1)
	go func() { ch <- b.Release(ctx, l) }()
	return ch
}

func recv[T any](t *testing.T, ch chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(20 * time.Second):
		t.Fatal("no answer")
		panic("unreachable")
	}
}

// The conformance suite with every call that meets another in flight
// coalesced.
func TestGroupCommitConformance(t *testing.T) {
	t.Parallel()
	for _, f := range flavours {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			backendtest.Run(t, harness(func(t *testing.T) sqllock.Backend {
				_, b := f.bundle(t, Options{})
				coalesceAlways(b)
				return asClient(b)
			}, f.mayskip...))
		})
	}
}

// Many goroutines acquire and release a few keys through coalescing: no two
// holders of a key ever overlap (a holder marks the key in memory from its
// grant until just before its release is sent), and each key's tokens
// strictly increase from one grant to the next.
func TestGroupCommitHistory(t *testing.T) {
	t.Parallel()
	for _, f := range flavours {
		t.Run(f.name, func(t *testing.T) {
			t.Parallel()
			_, b := f.bundle(t, Options{})
			groupCommitHistory(t, b)
		})
	}
}

func groupCommitHistory(t *testing.T, b *Backend) {
	coalesceAlways(b)
	ctx := testCtx(t)
	const keys, workers, pairs = 6, 24, 40
	var (
		holder  [keys]atomic.Int64 // the token holding the key, 0 when free
		last    [keys]atomic.Int64 // the last token granted
		grants  atomic.Int64
		refused atomic.Int64
		seq     atomic.Int64
		wg      sync.WaitGroup
	)
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 1))
			for range pairs {
				k := rng.IntN(keys)
				key := fmt.Sprintf("k%d", k)
				if rng.IntN(3) == 0 {
					key = fmt.Sprintf("new%d-%d", w, seq.Add(1)) // a first insert
					k = -1
				}
				l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: fmt.Sprintf("w%d/%d", w, seq.Add(1))})
				if errors.Is(err, sqllock.ErrNotAcquired) {
					refused.Add(1)
					continue
				}
				if err != nil {
					errs <- err
					return
				}
				grants.Add(1)
				if k >= 0 {
					if !holder[k].CompareAndSwap(0, l.Token) {
						errs <- fmt.Errorf("%s: token %d granted while token %d holds it", key, l.Token, holder[k].Load())
						return
					}
					if prev := last[k].Swap(l.Token); l.Token <= prev {
						errs <- fmt.Errorf("%s: token %d granted after token %d", key, l.Token, prev)
						return
					}
					holder[k].Store(0)
				}
				if err := b.Release(ctx, l); err != nil {
					errs <- fmt.Errorf("release %s token %d: %w", key, l.Token, err)
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
	t.Logf("grants %d, refused %d, acquire batches %d, release batches %d, conflict resends %d",
		grants.Load(), refused.Load(), b.acquireQ.Batches(), b.releaseQ.Batches(), b.conflictRetries.Load())
	require.Positive(t, b.acquireQ.Batches(), "no acquire was coalesced")
	require.Positive(t, b.releaseQ.Batches(), "no release was coalesced")
	require.Greater(t, grants.Load(), int64(workers*pairs/4))
}

// A row locked by another transaction (as FencedTx holds its lease's row
// FOR SHARE) does not stall the other keys of a batch: they are answered
// at once, and the locked key's call is sent again alone, waits for the
// row and succeeds once it is unlocked. Acquires and releases alike.
func TestGroupCommitLockedRowDoesNotStall(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	for _, k := range []string{"locked", "free", "rlocked", "rfree"} {
		l := acquireOK(t, b, k, "setup", time.Minute)
		require.NoError(t, b.Release(ctx, l))
	}
	rl := acquireOK(t, b, "rlocked", "o", time.Minute)
	rf := acquireOK(t, b, "rfree", "o", time.Minute)
	tx := holdRows(t, bundle.db.Pool, b.table, "FOR SHARE", "locked", "rlocked")

	holdQueue(b.acquireQ)
	lockedCh := goAcquire(ctx, b, "locked", "o1")
	freeCh := goAcquire(ctx, b, "free", "o2")
	waitQueued(t, b.acquireQ, 2)
	holdQueue(b.releaseQ)
	rlockedCh := goRelease(ctx, b, rl)
	rfreeCh := goRelease(ctx, b, rf)
	waitQueued(t, b.releaseQ, 2)
	flushQueue(b.acquireQ)
	flushQueue(b.releaseQ)

	free := recv(t, freeCh)
	require.NoError(t, free.err, "the free key of the batch")
	require.NoError(t, recv(t, rfreeCh), "the free lease of the batch")
	time.Sleep(100 * time.Millisecond)
	require.Empty(t, lockedCh, "the locked key was answered while its row was locked")
	require.Empty(t, rlockedCh, "the locked lease was answered while its row was locked")
	require.NoError(t, tx.Commit(ctx))
	locked := recv(t, lockedCh)
	require.NoError(t, locked.err)
	require.EqualValues(t, 2, locked.l.Token)
	require.NoError(t, recv(t, rlockedCh))
	require.EqualValues(t, 1, b.acquireQ.Batches())
	require.EqualValues(t, 1, b.releaseQ.Batches())
	unholdQueue(t, b.acquireQ)
	unholdQueue(t, b.releaseQ)
}

// Two Backends (two processes' worth, each with its own pool) coalescing
// overlapping sets of keys concurrently: no caller ever gets an error other
// than "held" (no deadlock reaches a caller).
func TestGroupCommitTwoBackends(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	ctx := testCtx(t)
	var backends []*Backend
	for range 2 {
		b, err := New(newPool(t, bundle, nil), Options{})
		require.NoError(t, err)
		t.Cleanup(func() { b.Close() })
		coalesceAlways(b)
		backends = append(backends, b)
	}
	var wg sync.WaitGroup
	errs := make(chan error, 32)
	var grants atomic.Int64
	for i := range 32 {
		b := backends[i%2]
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(i), 2))
			for j := range 30 {
				key := "k" + strconv.Itoa(rng.IntN(12))
				if j%4 == 0 {
					key = "n" + strconv.Itoa(rng.IntN(200)) // first inserts, in both processes
				}
				l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: fmt.Sprintf("p%d/%d", i, j)})
				if errors.Is(err, sqllock.ErrNotAcquired) {
					continue
				}
				if err == nil {
					grants.Add(1)
					err = b.Release(ctx, l)
				}
				if err != nil {
					errs <- err
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
	var batches, resends int64
	for _, b := range backends {
		batches += b.acquireQ.Batches() + b.releaseQ.Batches()
		resends += b.conflictRetries.Load()
	}
	t.Logf("grants %d, batches %d, conflict resends %d", grants.Load(), batches, resends)
	require.Positive(t, batches)
}

// Without other calls in flight a call is sent at once, alone, with the
// single statement: no batch is ever sent by calls one after another (and
// TestOneRoundTripPerOperation counts one round trip for each, with group
// commit on by default).
func TestGroupCommitIdleSendsAlone(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	require.Equal(t, groupCommitInFlight, b.acquireQ.Limit, "on by default")
	for i := range 20 {
		l := acquireOK(t, b, "k"+strconv.Itoa(i%3), "o", time.Minute)
		require.NoError(t, b.Release(testCtx(t), l))
	}
	require.Zero(t, b.acquireQ.Batches())
	require.Zero(t, b.releaseQ.Batches())
	require.Zero(t, b.acquireQ.Sending())
	require.Zero(t, b.releaseQ.Sending())

	off := newBundle(t, Options{DisableGroupCommit: true}).backend
	require.Zero(t, off.acquireQ.Limit)
}

// Two calls for one key never share a batch: the second goes in the next
// (here alone, as the only call left in the queue).
func TestGroupCommitSameKeyTwice(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	ctx := testCtx(t)
	require.NoError(t, b.Release(ctx, acquireOK(t, b, "d", "setup", time.Minute)))
	holdQueue(b.acquireQ)
	first := goAcquire(ctx, b, "d", "o1")
	waitQueued(t, b.acquireQ, 1)
	other := goAcquire(ctx, b, "e", "o3")
	waitQueued(t, b.acquireQ, 2)
	second := goAcquire(ctx, b, "d", "o2")
	waitQueued(t, b.acquireQ, 3)
	flushQueue(b.acquireQ)
	r1, r2, r3 := recv(t, first), recv(t, second), recv(t, other)
	require.NoError(t, r1.err)
	require.EqualValues(t, 2, r1.l.Token)
	require.NoError(t, r3.err)
	var he *sqllock.HeldError
	require.ErrorAs(t, r2.err, &he)
	require.Equal(t, "o1", he.Owner, "the second call saw the first's grant")
	require.EqualValues(t, 1, b.acquireQ.Batches(), "one batch, then the second call alone")
	require.Zero(t, b.acquireQ.Alone(), "the batch answered both of its members")
	unholdQueue(t, b.acquireQ)
}

// A call whose context ends while it is queued leaves the queue, and
// nothing of it is ever sent.
func TestGroupCommitQueuedCancelSendsNothing(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	holdQueue(b.acquireQ)
	ctx, cancel := context.WithCancel(testCtx(t))
	ch := goAcquire(ctx, b, "c", "o")
	waitQueued(t, b.acquireQ, 1)
	cancel()
	r := recv(t, ch)
	require.ErrorIs(t, r.err, context.Canceled)
	require.NotErrorIs(t, r.err, sqllock.ErrIndeterminate)
	require.ErrorContains(t, r.err, "not sent")
	waitQueued(t, b.acquireQ, 0)
	flushQueue(b.acquireQ)
	unholdQueue(t, b.acquireQ)
	require.Zero(t, b.acquireQ.Batches())
	var n int
	require.NoError(t, b.pool.QueryRow(testCtx(t), "SELECT count(*) FROM "+b.table).Scan(&n))
	require.Zero(t, n, "the cancelled call was sent")
}

// A call whose context ends while its batch is in flight returns at once,
// indeterminate, as the single statement does; the batch goes on for the
// others (one member's context does not cancel it); and the same owner's
// repeat gets the grant back with its token.
func TestGroupCommitInFlightCancel(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	slowFirstCommit(t, b, 800*time.Millisecond)
	holdQueue(b.acquireQ)
	actx, cancel := context.WithCancel(testCtx(t))
	defer cancel()
	a := goAcquire(actx, b, "x1", "oa")
	other := goAcquire(testCtx(t), b, "x2", "ob")
	waitQueued(t, b.acquireQ, 2)
	flushQueue(b.acquireQ)
	time.Sleep(200 * time.Millisecond) // the batch is committing
	cancel()
	ra := recv(t, a)
	require.ErrorIs(t, ra.err, sqllock.ErrIndeterminate)
	ro := recv(t, other)
	require.NoError(t, ro.err, "the batch was cancelled by another member's context")
	require.EqualValues(t, 1, ro.l.Token)
	unholdQueue(t, b.acquireQ)
	again := acquireOK(t, b, "x1", "oa", time.Minute)
	require.EqualValues(t, 1, again.Token, "the repeat gets the grant back")
}

// A batch whose reply is lost (the connection breaks after the batch
// reached the server) leaves every member indeterminate; each repeat by
// the same owner gets its grant back with the same token.
func TestGroupCommitLostReply(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b, proxy := proxied(t, bundle, 0)
	ctx := testCtx(t)
	acquireOK(t, b, "warm", "o", time.Minute) // the pooler check and a first connection

	holdQueue(b.acquireQ)
	keys := []string{"a", "b", "c"}
	var chs []chan acquireResult
	for i, k := range keys {
		chs = append(chs, goAcquire(ctx, b, k, "lost/"+k))
		waitQueued(t, b.acquireQ, i+1)
	}
	proxy.BlackholeRepliesAfter([]byte("lost/"))
	flushQueue(b.acquireQ)
	// Wait until the batch has committed, then break its connection.
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, bundle.db.Pool.QueryRow(ctx, "SELECT count(*) FROM "+b.table+" WHERE owner LIKE 'lost/%' AND held").Scan(&n))
		return n == len(keys)
	}, 10*time.Second, 5*time.Millisecond)
	proxy.Reset()
	for _, ch := range chs {
		r := recv(t, ch)
		require.ErrorIs(t, r.err, sqllock.ErrIndeterminate)
	}
	unholdQueue(t, b.acquireQ)
	proxy.Pass()
	for _, k := range keys {
		l := acquireOK(t, b, k, "lost/"+k, time.Minute)
		require.EqualValues(t, 1, l.Token, "the repeat of %s gets its grant back", k)
	}
}

// The release of a lease a waiter marked notifies the waiter, also when
// it goes in a batch.
func TestGroupCommitReleaseNotifies(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	l := acquireOK(t, b, "w", "holder", time.Minute)
	other := acquireOK(t, b, "u", "holder", time.Minute)
	ch, stop := b.Watch("w")
	defer stop()
	<-ch               // the listener is listening
	waiting(t, b, "w") // marks the lease
	holdQueue(b.releaseQ)
	r1 := goRelease(testCtx(t), b, l)
	r2 := goRelease(testCtx(t), b, other)
	waitQueued(t, b.releaseQ, 2)
	flushQueue(b.releaseQ)
	require.NoError(t, recv(t, r1))
	require.NoError(t, recv(t, r2))
	require.EqualValues(t, 1, b.releaseQ.Batches())
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatal("a batched release of a marked lease did not notify")
	}
	unholdQueue(t, b.releaseQ)
}

// The batch statement grants durably whatever the session says, also when
// some of its keys are refused; an acquire that waits (the waiting form,
// whose mark commits asynchronously) is never coalesced: it is sent alone
// at once even while calls queue.
func TestGroupCommitGrantsDurable(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	acquireOK(t, b, "held", "holder", time.Minute)

	tx, err := bundle.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	_, err = tx.Exec(ctx, "SET LOCAL synchronous_commit = off")
	require.NoError(t, err)
	rows, err := tx.Query(ctx, b.full.acquireBatch, []string{"g1", "held", "g2"},
		[]int64{leaseMicros(time.Minute), leaseMicros(time.Minute), leaseMicros(time.Minute)},
		[]string{"o", "o", "o"}, [][]byte{nil, nil, []byte("v")}, []int64{0, 0, 0})
	require.NoError(t, err)
	granted := map[string]bool{}
	for rows.Next() {
		vals, err := rows.Values()
		require.NoError(t, err)
		granted[vals[0].(string)] = vals[1].(bool)
	}
	require.NoError(t, rows.Err())
	require.Equal(t, map[string]bool{"g1": true, "held": false, "g2": true}, granted)
	var s string
	require.NoError(t, tx.QueryRow(ctx, "SHOW synchronous_commit").Scan(&s))
	require.Equal(t, "on", s, "a batch that grants must commit synchronously")
	require.NoError(t, tx.Rollback(ctx))

	holdQueue(b.acquireQ)
	_, stop := b.Watch("held")
	defer stop()
	_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "held", TTL: time.Minute, Owner: "waiter"})
	require.ErrorIs(t, err, sqllock.ErrNotAcquired, "a waiting acquire was queued")
	flushQueue(b.acquireQ)
	unholdQueue(t, b.acquireQ)
	require.Zero(t, b.acquireQ.Batches())
}

// Per-lease outcomes of a batch of releases are the single release's: a
// valid lease released, an expired one reported expired (and cleared), one
// taken by a newer token reported taken, a repeat of a release nil.
func TestGroupCommitReleaseOutcomes(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	ctx := testCtx(t)
	valid := acquireOK(t, b, "valid", "o1", time.Minute)
	expired := acquireOK(t, b, "expired", "o1", time.Minute)
	expire(t, b, "expired")
	taken := acquireOK(t, b, "taken", "o1", time.Minute)
	expire(t, b, "taken")
	acquireOK(t, b, "taken", "o2", time.Minute)
	again := acquireOK(t, b, "again", "o1", time.Minute)
	require.NoError(t, b.Release(ctx, again))

	holdQueue(b.releaseQ)
	var chs []chan error
	for i, l := range []sqllock.Lease{valid, expired, taken, again} {
		chs = append(chs, goRelease(ctx, b, l))
		waitQueued(t, b.releaseQ, i+1)
	}
	flushQueue(b.releaseQ)
	require.NoError(t, recv(t, chs[0]))
	var lost *sqllock.LostError
	require.ErrorAs(t, recv(t, chs[1]), &lost)
	require.Equal(t, sqllock.LostExpired, lost.Reason)
	require.ErrorAs(t, recv(t, chs[2]), &lost)
	require.Equal(t, sqllock.LostTaken, lost.Reason)
	require.NoError(t, recv(t, chs[3]))
	require.EqualValues(t, 1, b.releaseQ.Batches())
	require.Zero(t, b.releaseQ.Alone(), "the batch answered every member")
	unholdQueue(t, b.releaseQ)
	infos, err := b.List(ctx, "")
	require.NoError(t, err)
	for _, i := range infos {
		require.Equal(t, i.Key == "taken", i.Held, "%s", i.Key)
	}
}

// A batch the server refuses (here a trigger that fails every batch
// statement, as a deadlock or serialization failure left after the resends
// would) was rolled back and applied nothing: each member is then sent
// alone, and gets the single statement's answer, not the batch's error.
func TestGroupCommitRefusedBatchSendsEachAlone(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	ctx := testCtx(t)
	held := acquireOK(t, b, "a", "other", time.Minute)
	require.NoError(t, b.Release(ctx, acquireOK(t, b, "b", "setup", time.Minute)))
	_, err := b.pool.Exec(ctx, `
CREATE FUNCTION refuse_batches() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF current_query() LIKE '%unnest((SELECT $1::text[])%' THEN
        RAISE EXCEPTION 'batch refused' USING ERRCODE = 'serialization_failure';
    END IF;
    RETURN NULL;
END $$`)
	require.NoError(t, err)
	_, err = b.pool.Exec(ctx, "CREATE TRIGGER refuse_batches BEFORE INSERT OR UPDATE ON "+b.table+
		" FOR EACH STATEMENT EXECUTE FUNCTION refuse_batches()")
	require.NoError(t, err)

	holdQueue(b.acquireQ)
	chs := map[string]chan acquireResult{}
	for i, key := range []string{"a", "b", "c"} {
		chs[key] = goAcquire(ctx, b, key, "o1")
		waitQueued(t, b.acquireQ, i+1)
	}
	flushQueue(b.acquireQ)
	ra, rb, rc := recv(t, chs["a"]), recv(t, chs["b"]), recv(t, chs["c"])
	unholdQueue(t, b.acquireQ)
	require.EqualValues(t, 1, b.acquireQ.Batches(), "the calls went as one batch")
	var he *sqllock.HeldError
	require.ErrorAs(t, ra.err, &he, "a held key, sent alone after the batch failed")
	require.Equal(t, "other", he.Owner)
	require.Equal(t, held.Token, he.Token)
	require.NoError(t, rb.err, "a free key, sent alone after the batch failed")
	require.EqualValues(t, 2, rb.l.Token)
	require.NoError(t, rc.err, "a new key, sent alone after the batch failed")
	require.EqualValues(t, 1, rc.l.Token)

	holdQueue(b.releaseQ)
	rels := []chan error{goRelease(ctx, b, rb.l)}
	waitQueued(t, b.releaseQ, 1)
	rels = append(rels, goRelease(ctx, b, rc.l))
	waitQueued(t, b.releaseQ, 2)
	flushQueue(b.releaseQ)
	for _, ch := range rels {
		require.NoError(t, recv(t, ch), "a release, sent alone after the batch failed")
	}
	unholdQueue(t, b.releaseQ)
	require.EqualValues(t, 1, b.releaseQ.Batches(), "the releases went as one batch")
	infos, err := b.List(ctx, "")
	require.NoError(t, err)
	for _, in := range infos {
		require.Equal(t, in.Key == "a", in.Held, "%s", in.Key)
	}
}

// Group commit through PgBouncer, in transaction mode with each exec mode
// docs/pgbouncer.md documents and in session mode: concurrent acquires, and
// releases, go as one batch statement each (unnest of array parameters,
// which each exec mode encodes its own way), the batch itself answers
// every member (none is left to be sent alone, which would hide a batch
// statement that fails through the pooler), and each member gets the
// single statement's outcome. In session mode a batched release of a
// marked lease notifies its waiter.
func TestGroupCommitPgBouncer(t *testing.T) {
	t.Parallel()
	t.Run("Transaction", func(t *testing.T) {
		t.Parallel()
		bouncer := pgtest.NewPgBouncer(t, pgtest.PoolTransaction, nil)
		for _, mode := range transactionModes {
			t.Run(mode.String(), func(t *testing.T) {
				t.Parallel()
				groupCommitBatches(t, bouncerBackend(t, bouncer, mode, Options{DisableNotify: true}))
			})
		}
	})
	t.Run("Session", func(t *testing.T) {
		t.Parallel()
		bouncer := pgtest.NewPgBouncer(t, pgtest.PoolSession, nil)
		groupCommitBatches(t, bouncerBackend(t, bouncer, pgx.QueryExecModeCacheStatement, Options{}))
	})
}

// groupCommitBatches sends one batch of acquires and one of releases
// through b, each member with a different outcome, and checks them.
func groupCommitBatches(t *testing.T, b *Backend) {
	ctx := testCtx(t)
	require.NoError(t, b.Release(ctx, acquireOK(t, b, "free", "setup", time.Minute)))
	acquireOK(t, b, "held", "other", time.Minute)
	stale := acquireOK(t, b, "expired", "other", time.Minute)
	expire(t, b, "expired")

	holdQueue(b.acquireQ)
	reqs := []sqllock.AcquireRequest{
		{Key: "free", Owner: "o"},
		{Key: "held", Owner: "o"},
		{Key: "new", Owner: "o", Value: []byte("v\x00\\'\"{,}")}, // bytes that text arrays quote
		{Key: "expired", Owner: "o"},
	}
	var chs []chan acquireResult
	for i, req := range reqs {
		req.TTL = time.Minute
		ch := make(chan acquireResult, 1)
		go func() {
			l, err := b.TryAcquire(ctx, req)
			ch <- acquireResult{l, err}
		}()
		chs = append(chs, ch)
		waitQueued(t, b.acquireQ, i+1)
	}
	flushQueue(b.acquireQ)
	free, held, fresh, expired := recv(t, chs[0]), recv(t, chs[1]), recv(t, chs[2]), recv(t, chs[3])
	unholdQueue(t, b.acquireQ)
	require.EqualValues(t, 1, b.acquireQ.Batches(), "the acquires went as one batch")
	require.Zero(t, b.acquireQ.Alone(), "the batch left members to be sent alone")
	require.NoError(t, free.err)
	require.EqualValues(t, 2, free.l.Token)
	var he *sqllock.HeldError
	require.ErrorAs(t, held.err, &he)
	require.Equal(t, "other", he.Owner)
	require.NoError(t, fresh.err)
	require.EqualValues(t, 1, fresh.l.Token)
	require.NoError(t, expired.err)
	require.Equal(t, stale.Token+1, expired.l.Token)
	infos, err := b.List(ctx, "new")
	require.NoError(t, err)
	require.Len(t, infos, 1)
	require.Equal(t, reqs[2].Value, infos[0].Value, "the value, through the batch's bytea array")

	// Watched only now: an acquire that waits is never coalesced.
	var watched <-chan struct{}
	if b.notify {
		ch, stop := b.Watch("held")
		defer stop()
		<-ch                  // the listener is listening
		waiting(t, b, "held") // marks the lease, whose release below notifies
		watched = ch
	}
	holdQueue(b.releaseQ)
	var rels []chan error
	for i, l := range []sqllock.Lease{free.l, fresh.l, stale} {
		rels = append(rels, goRelease(ctx, b, l))
		waitQueued(t, b.releaseQ, i+1)
	}
	heldLease, err := b.List(ctx, "held")
	require.NoError(t, err)
	rels = append(rels, goRelease(ctx, b, sqllock.Lease{Key: "held", Token: heldLease[0].Token, Owner: "other"}))
	waitQueued(t, b.releaseQ, 4)
	flushQueue(b.releaseQ)
	require.NoError(t, recv(t, rels[0]))
	require.NoError(t, recv(t, rels[1]))
	var lost *sqllock.LostError
	require.ErrorAs(t, recv(t, rels[2]), &lost)
	require.Equal(t, sqllock.LostTaken, lost.Reason)
	require.NoError(t, recv(t, rels[3]))
	unholdQueue(t, b.releaseQ)
	require.EqualValues(t, 1, b.releaseQ.Batches(), "the releases went as one batch")
	require.Zero(t, b.releaseQ.Alone(), "the batch left members to be sent alone")
	infos, err = b.List(ctx, "")
	require.NoError(t, err)
	require.Len(t, infos, 4)
	for _, i := range infos {
		require.Equal(t, i.Key == "expired", i.Held, "%s", i.Key)
	}
	if watched != nil {
		select {
		case <-watched:
		case <-time.After(10 * time.Second):
			t.Fatal("a batched release of a marked lease did not notify through PgBouncer in session mode")
		}
	}
}

// Tokens in a batch are the single statement's: a new tenure of a
// released key, or of an expired one, takes the next token; a same-owner
// repeat (an acquire whose reply was lost, sent again while others are in
// flight) gets the grant back with its token and a deadline no earlier
// than before: a new token would be a second tenure of one acquire (G6).
func TestGroupCommitTokens(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	ctx := testCtx(t)
	require.NoError(t, b.Release(ctx, acquireOK(t, b, "k", "setup", time.Minute)))
	first := acquireOK(t, b, "k", "o", time.Minute)
	require.EqualValues(t, 2, first.Token)
	released := acquireOK(t, b, "released", "setup", time.Minute)
	require.NoError(t, b.Release(ctx, released))
	expired := acquireOK(t, b, "expired", "setup", time.Minute)
	expire(t, b, "expired")

	res := acquireBatch(t, b,
		sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o"},
		sqllock.AcquireRequest{Key: "released", TTL: time.Minute, Owner: "o"},
		sqllock.AcquireRequest{Key: "expired", TTL: time.Minute, Owner: "o"})
	require.EqualValues(t, 1, b.acquireQ.Batches(), "the calls went as one batch")
	r, rr, re := res[0], res[1], res[2]
	require.NoError(t, rr.err)
	require.Equal(t, released.Token+1, rr.l.Token, "a new tenure of a released key")
	require.NoError(t, re.err)
	require.Equal(t, expired.Token+1, re.l.Token, "a new tenure of an expired key")
	require.NoError(t, r.err, "the same owner's repeat is granted")
	require.Equal(t, first.Token, r.l.Token, "the batched repeat took a new token")
	require.False(t, r.l.Deadline.Before(first.Deadline), "the repeat moved the deadline back")
	var token int64
	require.NoError(t, b.pool.QueryRow(ctx, "SELECT token FROM "+b.table+" WHERE key = 'k'").Scan(&token))
	require.Equal(t, first.Token, token)
}

// A batch neither locks nor writes the row of a key it refuses (held by
// another owner, live): a batch of refusals assigns no transaction id, and
// while a batch's transaction is open, the refused key's row can be locked
// FOR SHARE NOWAIT from another connection (as a fenced transaction locks
// it), while the row it granted cannot.
func TestGroupCommitRefusalLocksNoRow(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	acquireOK(t, b, "held", "holder", time.Minute)
	acquireOK(t, b, "held2", "holder", time.Minute)
	require.NoError(t, b.Release(ctx, acquireOK(t, b, "free", "setup", time.Minute)))

	// batch sends the Backend's own batch statement on tx, bound as
	// sendAcquires binds it, and returns granted per key.
	batch := func(tx pgx.Tx, keys ...string) map[string]bool {
		t.Helper()
		n := len(keys)
		micros, owners, values, holds := make([]int64, n), make([]string, n), make([][]byte, n), make([]int64, n)
		for i := range keys {
			micros[i], owners[i] = leaseMicros(time.Minute), "o"
		}
		rows, err := tx.Query(ctx, b.full.acquireBatch, keys, micros, owners, values, holds)
		require.NoError(t, err)
		granted := map[string]bool{}
		for rows.Next() {
			vals, err := rows.Values()
			require.NoError(t, err)
			granted[vals[0].(string)] = vals[1].(bool)
		}
		require.NoError(t, rows.Err())
		return granted
	}
	// lockable reports whether another connection can lock key's row now.
	lockable := func(key string) bool {
		t.Helper()
		probe, err := bundle.db.Pool.Begin(ctx)
		require.NoError(t, err)
		defer probe.Rollback(ctx)
		_, err = probe.Exec(ctx, "SELECT FROM "+b.table+" WHERE key = $1 FOR SHARE NOWAIT", key)
		if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok && pgErr.Code == "55P03" {
			return false
		}
		require.NoError(t, err)
		return true
	}

	tx, err := bundle.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	require.Equal(t, map[string]bool{"held": false, "held2": false}, batch(tx, "held", "held2"))
	var xid *int64
	require.NoError(t, tx.QueryRow(ctx, "SELECT pg_current_xact_id_if_assigned()::text::bigint").Scan(&xid))
	require.Nil(t, xid, "a batch of refusals locked or wrote a row")
	require.True(t, lockable("held"), "a refused key's row is locked by the batch")
	require.NoError(t, tx.Rollback(ctx))

	tx, err = bundle.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer tx.Rollback(ctx)
	require.Equal(t, map[string]bool{"held": false, "free": true}, batch(tx, "held", "free"))
	require.False(t, lockable("free"), "the probe cannot see a row lock")
	require.True(t, lockable("held"), "a refused key's row is locked by the batch that refused it")
	require.NoError(t, tx.Rollback(ctx))
}

// A batched release notifies only for the leases a waiter marked: the
// notifications the table's channel receives, up to a later release that
// notifies after the batch's commit, are the marked lease's alone.
func TestGroupCommitReleaseNotifiesOnlyWhenWaited(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	conn, err := bundle.db.Pool.Acquire(ctx)
	require.NoError(t, err)
	defer conn.Release()
	var channel string
	require.NoError(t, conn.QueryRow(ctx, b.full.channel).Scan(&channel))
	_, err = conn.Exec(ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize())
	require.NoError(t, err)
	defer conn.Exec(context.Background(), "UNLISTEN *")

	quiet := acquireOK(t, b, "quiet", "o", time.Minute)
	quiet2 := acquireOK(t, b, "quiet2", "o", time.Minute)
	loud := acquireOK(t, b, "loud", "o", time.Minute)
	last := acquireOK(t, b, "last", "o", time.Minute)
	_, stop := b.Watch("loud")
	defer stop()
	_, stopLast := b.Watch("last")
	defer stopLast()
	waiting(t, b, "loud")
	waiting(t, b, "last")

	holdQueue(b.releaseQ)
	var chs []chan error
	for i, l := range []sqllock.Lease{quiet, loud, quiet2} {
		chs = append(chs, goRelease(ctx, b, l))
		waitQueued(t, b.releaseQ, i+1)
	}
	flushQueue(b.releaseQ)
	for _, ch := range chs {
		require.NoError(t, recv(t, ch))
	}
	unholdQueue(t, b.releaseQ)
	require.EqualValues(t, 1, b.releaseQ.Batches(), "the releases went as one batch")
	require.NoError(t, b.Release(ctx, last)) // alone: notifies after the batch's commit

	var got []string
	wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for len(got) == 0 || got[len(got)-1] != "last" {
		n, err := conn.Conn().WaitForNotification(wctx)
		require.NoError(t, err, "notifications so far: %q", got)
		got = append(got, n.Payload)
	}
	require.Equal(t, []string{"loud", "last"}, got, "a batched release nobody waited for notified")
}
