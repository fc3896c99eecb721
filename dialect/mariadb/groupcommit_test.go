package mariadb

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/groupcommit"
	"github.com/ashlock/ashlock/sqllock"
	"github.com/ashlock/ashlock/sqllock/backendtest"
)

// Tests of the client-side group commit (groupcommit.go). To make a batch
// on purpose, a test fills the acquires in flight (holdQueue), so that
// calls queue, waits for them to be queued, and lets the queue go as one
// batch (flushQueue), as the end of an acquire in flight would.

// coalesceAlways makes b coalesce every acquire (release) that arrives
// while one is in flight.
func coalesceAlways(b *Backend) {
	b.acquireQ.Limit, b.releaseQ.Limit = 1, 1
	b.acquireQ.Calls, b.releaseQ.Calls = 0, 0
}

func holdQueue(b *Backend) { holdQ(b.acquireQ) }

func holdQ[Req, Res any](q *groupcommit.Queue[Req, Res]) { q.Hold() }

// waitQueued waits until n acquires are queued in b.
func waitQueued(t *testing.T, b *Backend, n int) { t.Helper(); waitQ(t, b.acquireQ, n) }

func waitQ[Req, Res any](t *testing.T, q *groupcommit.Queue[Req, Res], n int) {
	t.Helper()
	require.Eventually(t, func() bool { return q.Queued() == n }, 10*time.Second, time.Millisecond, "calls queued")
}

// flushQueue ends one held acquire: the queue goes as batches.
func flushQueue(b *Backend) { b.acquireQ.Flush() }

// unholdQueue waits for the batches to end and frees the held acquires.
func unholdQueue(t *testing.T, b *Backend) { t.Helper(); unholdQ(t, b.acquireQ) }

func unholdQ[Req, Res any](t *testing.T, q *groupcommit.Queue[Req, Res]) {
	t.Helper()
	require.Eventually(t, q.Unhold, 20*time.Second, time.Millisecond)
}

type acquireResult struct {
	l   sqllock.Lease
	err error
}

func goAcquire(ctx context.Context, b *Backend, req sqllock.AcquireRequest) chan acquireResult {
	ch := make(chan acquireResult, 1)
	go func() {
		l, err := b.TryAcquire(ctx, req)
		ch <- acquireResult{l, err}
	}()
	return ch
}

func recv[T any](t *testing.T, ch chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(30 * time.Second):
		t.Fatal("no answer")
		panic("unreachable")
	}
}

// acquireBatch sends reqs as one batch (queued one after the other, in
// this order) and returns their results.
func acquireBatch(t *testing.T, b *Backend, reqs ...sqllock.AcquireRequest) []acquireResult {
	t.Helper()
	holdQueue(b)
	var chs []chan acquireResult
	for i, r := range reqs {
		chs = append(chs, goAcquire(testCtx(t), b, r))
		waitQueued(t, b, i+1)
	}
	flushQueue(b)
	out := make([]acquireResult, len(chs))
	for i, ch := range chs {
		out[i] = recv(t, ch)
	}
	unholdQueue(t, b)
	return out
}

// The conformance suite with every acquire that meets another in flight
// coalesced.
func TestGroupCommitConformance(t *testing.T) {
	t.Parallel()
	var dbs sync.Map // *Backend -> *sql.DB
	backendtest.Run(t, backendtest.Harness{
		New: func(t *testing.T) sqllock.Backend {
			b, db := newBackend(t)
			coalesceAlways(b)
			dbs.Store(b, db)
			return b
		},
		Expire: func(t *testing.T, b sqllock.Backend, key string) {
			expire(t, handle(&dbs, b), b.(*Backend), key)
		},
		SetToken: func(t *testing.T, b sqllock.Backend, key string, token int64) {
			setToken(t, handle(&dbs, b), b.(*Backend), key, token)
		},
	})
}

// The answers of one batch are those of the same calls sent alone, one
// after the other, on a database in the same state: for a new key (with a
// value of awkward bytes and an awkward key), a released one, an expired
// one, one held by another owner (its holder, token and value), the same
// owner's repeat inside its min hold (its token, its deadline not before
// the hold), the same owner's acquire after its own lease expired (a new
// tenure), a key released inside its min hold (refused until the hold
// ends), and a grant with a min hold longer than its TTL; and the rows
// the two leave are the same, also after the release of a lease inside
// the min hold the batch granted.
func TestGroupCommitAnswersAsAlone(t *testing.T) {
	t.Parallel()
	const hold = 10 * time.Minute
	setup := func(t *testing.T, b *Backend, db *sql.DB) {
		ctx := testCtx(t)
		get := func(req sqllock.AcquireRequest) sqllock.Lease {
			l, err := b.tryAcquire(ctx, req)
			require.NoError(t, err)
			return l
		}
		require.NoError(t, b.Release(ctx, get(sqllock.AcquireRequest{Key: "released", TTL: time.Minute, Owner: "setup"})))
		get(sqllock.AcquireRequest{Key: "expired", TTL: time.Minute, Owner: "setup"})
		expire(t, db, b, "expired")
		get(sqllock.AcquireRequest{Key: "held", TTL: time.Minute, Owner: "other", Value: []byte("hv")})
		get(sqllock.AcquireRequest{Key: "repeat", TTL: time.Minute, Owner: "o-repeat", MinHold: hold})
		get(sqllock.AcquireRequest{Key: "repeat-expired", TTL: time.Minute, Owner: "o-again"})
		expire(t, db, b, "repeat-expired")
		require.NoError(t, b.Release(ctx, get(sqllock.AcquireRequest{Key: "kept", TTL: time.Minute, Owner: "o-kept", MinHold: hold})))
	}
	reqs := []sqllock.AcquireRequest{
		{Key: "new", Owner: "o", Value: []byte("v\x00\xff'\"\\{,}")},
		{Key: "spé<ci&al\"\\", Owner: "ö<&>"},
		{Key: "released", Owner: "o"},
		{Key: "expired", Owner: "o"},
		{Key: "held", Owner: "o"},
		{Key: "repeat", Owner: "o-repeat", Value: []byte("again")},
		{Key: "repeat-expired", Owner: "o-again"},
		{Key: "kept", Owner: "o"},
		{Key: "min-hold", Owner: "o", MinHold: hold},
	}
	for i := range reqs {
		reqs[i].TTL = time.Minute
	}

	batched, bdb := newBackend(t)
	coalesceAlways(batched)
	setup(t, batched, bdb)
	got := acquireBatch(t, batched, reqs...)
	require.EqualValues(t, 1, batched.acquireQ.Batches(), "the calls went as one batch")
	require.Zero(t, batched.acquireQ.Alone(), "the batch left members to be sent alone")

	alone, adb := newBackend(t)
	setup(t, alone, adb)
	aloneLeases := make([]sqllock.Lease, len(reqs))
	for i, req := range reqs {
		l, err := alone.tryAcquire(testCtx(t), req)
		aloneLeases[i] = l
		g := got[i]
		if err != nil {
			var want, have *sqllock.HeldError
			require.ErrorAs(t, err, &want, "%s", req.Key)
			require.ErrorAs(t, g.err, &have, "%s: alone %v, batched %v", req.Key, err, g.err)
			require.Equal(t, want.Owner, have.Owner, "%s", req.Key)
			require.Equal(t, want.Token, have.Token, "%s", req.Key)
			require.Equal(t, want.Value, have.Value, "%s", req.Key)
			require.InDelta(t, want.Remaining.Seconds(), have.Remaining.Seconds(), 5, "%s", req.Key)
			continue
		}
		require.NoError(t, g.err, "%s", req.Key)
		require.Equal(t, l.Key, g.l.Key)
		require.Equal(t, l.Token, g.l.Token, "%s", req.Key)
		require.Equal(t, l.Owner, g.l.Owner, "%s", req.Key)
		require.Equal(t, l.Value, g.l.Value, "%s", req.Key)
		require.InDelta(t, l.Deadline.Sub(l.BackendTime).Seconds(), g.l.Deadline.Sub(g.l.BackendTime).Seconds(), 5, "%s: lease length", req.Key)
	}
	// A few answers spelled out, so that both cannot be wrong alike.
	require.EqualValues(t, 2, got[2].l.Token, "a new tenure of a released key")
	require.EqualValues(t, 1, got[5].l.Token, "the same owner's repeat kept its token")
	require.Greater(t, got[5].l.Deadline.Sub(got[5].l.BackendTime), hold-time.Minute, "the repeat moved the deadline before its hold")
	require.EqualValues(t, 2, got[6].l.Token, "the same owner after its lease expired: a new tenure")
	require.Greater(t, got[8].l.Deadline.Sub(got[8].l.BackendTime), hold-time.Second, "the min hold of a new grant")
	var he *sqllock.HeldError
	require.ErrorAs(t, got[7].err, &he, "released inside its min hold")

	// The min hold a batch granted holds the key past its release, as
	// the single statement's does.
	require.NoError(t, batched.Release(testCtx(t), got[8].l))
	require.NoError(t, alone.Release(testCtx(t), aloneLeases[8]))

	bl, err := batched.List(testCtx(t), "")
	require.NoError(t, err)
	al, err := alone.List(testCtx(t), "")
	require.NoError(t, err)
	require.Len(t, bl, len(al))
	for i := range al {
		require.Equal(t, al[i].Key, bl[i].Key)
		require.Equal(t, al[i].Token, bl[i].Token, "%s", al[i].Key)
		require.Equal(t, al[i].Owner, bl[i].Owner, "%s", al[i].Key)
		require.Equal(t, al[i].Held, bl[i].Held, "%s", al[i].Key)
		require.Equal(t, al[i].Value, bl[i].Value, "%s", al[i].Key)
		require.InDelta(t, al[i].Remaining.Seconds(), bl[i].Remaining.Seconds(), 5, "%s", al[i].Key)
	}
}

// A batch the server refuses (here: one member's token is at the end of
// its space, error 1690) applied nothing: each member is sent alone and
// gets the single statement's answer.
func TestGroupCommitRefusedBatchSendsEachAlone(t *testing.T) {
	t.Parallel()
	b, db := newBackend(t)
	coalesceAlways(b)
	setToken(t, db, b, "end", math.MaxInt64)
	res := acquireBatch(t, b,
		sqllock.AcquireRequest{Key: "end", TTL: time.Minute, Owner: "o"},
		sqllock.AcquireRequest{Key: "fine", TTL: time.Minute, Owner: "o"})
	require.ErrorIs(t, res[0].err, sqllock.ErrTokenExhausted)
	require.NoError(t, res[1].err)
	require.EqualValues(t, 1, res[1].l.Token)
	require.EqualValues(t, 1, b.acquireQ.Batches())
	require.EqualValues(t, 2, b.acquireQ.Alone(), "each member of the refused batch was sent alone")
}

// A key goes at most once into a batch: a second call for it stays queued
// and is sent after the batch, and sees the first one's grant.
func TestGroupCommitSameKeyTwice(t *testing.T) {
	t.Parallel()
	b, _ := newBackend(t)
	coalesceAlways(b)
	ctx := testCtx(t)
	holdQueue(b)
	first := goAcquire(ctx, b, sqllock.AcquireRequest{Key: "d", TTL: time.Minute, Owner: "o1"})
	waitQueued(t, b, 1)
	other := goAcquire(ctx, b, sqllock.AcquireRequest{Key: "e", TTL: time.Minute, Owner: "o3"})
	waitQueued(t, b, 2)
	second := goAcquire(ctx, b, sqllock.AcquireRequest{Key: "d", TTL: time.Minute, Owner: "o2"})
	waitQueued(t, b, 3)
	flushQueue(b)
	r1, r2, r3 := recv(t, first), recv(t, second), recv(t, other)
	unholdQueue(t, b)
	require.NoError(t, r1.err)
	require.EqualValues(t, 1, r1.l.Token)
	require.NoError(t, r3.err)
	var he *sqllock.HeldError
	require.ErrorAs(t, r2.err, &he)
	require.Equal(t, "o1", he.Owner, "the second call saw the first's grant")
	require.EqualValues(t, 1, b.acquireQ.Batches(), "one batch, then the second call alone")
	require.Zero(t, b.acquireQ.Alone(), "the batch answered both of its members")
}

// A batch takes at most maxBatch members; the rest go in the next one.
func TestGroupCommitBatchBounded(t *testing.T) {
	t.Parallel()
	b, _ := newBackend(t)
	coalesceAlways(b)
	reqs := make([]sqllock.AcquireRequest, maxBatch+3)
	for i := range reqs {
		reqs[i] = sqllock.AcquireRequest{Key: "k" + strconv.Itoa(i), TTL: time.Minute, Owner: "o"}
	}
	holdQueue(b)
	var chs []chan acquireResult
	for _, r := range reqs {
		chs = append(chs, goAcquire(testCtx(t), b, r))
	}
	waitQueued(t, b, len(reqs))
	flushQueue(b)
	for _, ch := range chs {
		r := recv(t, ch)
		require.NoError(t, r.err)
		require.EqualValues(t, 1, r.l.Token)
	}
	unholdQueue(t, b)
	require.EqualValues(t, 2, b.acquireQ.Batches(), "%d calls: a full batch and one more", len(reqs))
}

// A call whose context ends while it is queued leaves the queue, and
// nothing of it is ever sent.
func TestGroupCommitQueuedCancelSendsNothing(t *testing.T) {
	t.Parallel()
	b, db := newBackend(t)
	coalesceAlways(b)
	holdQueue(b)
	ctx, cancel := context.WithCancel(testCtx(t))
	ch := goAcquire(ctx, b, sqllock.AcquireRequest{Key: "c", TTL: time.Minute, Owner: "o"})
	waitQueued(t, b, 1)
	cancel()
	r := recv(t, ch)
	require.ErrorIs(t, r.err, context.Canceled)
	require.NotErrorIs(t, r.err, sqllock.ErrIndeterminate)
	require.ErrorContains(t, r.err, "not sent")
	waitQueued(t, b, 0)
	flushQueue(b)
	unholdQueue(t, b)
	require.Zero(t, b.acquireQ.Batches())
	var n int
	require.NoError(t, db.QueryRowContext(testCtx(t), "SELECT count(*) FROM "+quotedTable(b)).Scan(&n))
	require.Zero(t, n, "the cancelled call was sent")
}

// lockRow holds key's row locked (FOR UPDATE) in a transaction of db
// until the returned func commits it.
func lockRow(t *testing.T, db *sql.DB, b *Backend, key string) func() {
	t.Helper()
	tx, err := db.BeginTx(testCtx(t), nil)
	require.NoError(t, err)
	var n int
	require.NoError(t, tx.QueryRowContext(testCtx(t), "SELECT token FROM "+quotedTable(b)+" WHERE `key` = ? FOR UPDATE", key).Scan(&n))
	var once sync.Once
	done := func() { once.Do(func() { require.NoError(t, tx.Commit()) }) }
	t.Cleanup(done)
	return done
}

// A call whose context ends while its batch is in flight (the batch waits
// for a row another transaction holds locked) returns at once,
// indeterminate, as the single statement does; the batch goes on for the
// others (one member's context does not cancel it); and the same owner's
// repeat gets the grant back with its token.
func TestGroupCommitInFlightCancel(t *testing.T) {
	t.Parallel()
	b, db := newBackend(t)
	coalesceAlways(b)
	l, err := b.tryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "locked", TTL: time.Minute, Owner: "setup"})
	require.NoError(t, err)
	require.NoError(t, b.Release(testCtx(t), l))
	unlock := lockRow(t, db, b, "locked")

	holdQueue(b)
	actx, cancel := context.WithCancel(testCtx(t))
	defer cancel()
	a := goAcquire(actx, b, sqllock.AcquireRequest{Key: "a-cancelled", TTL: time.Minute, Owner: "oa"})
	waitQueued(t, b, 1)
	other := goAcquire(testCtx(t), b, sqllock.AcquireRequest{Key: "locked", TTL: time.Minute, Owner: "ob"})
	waitQueued(t, b, 2)
	flushQueue(b)
	time.Sleep(300 * time.Millisecond) // the batch waits for the locked row
	cancel()
	ra := recv(t, a)
	require.ErrorIs(t, ra.err, sqllock.ErrIndeterminate)
	unlock()
	ro := recv(t, other)
	require.NoError(t, ro.err, "the batch was cancelled by another member's context")
	require.EqualValues(t, 2, ro.l.Token)
	unholdQueue(t, b)
	require.Zero(t, b.acquireQ.Alone())
	again, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "a-cancelled", TTL: time.Minute, Owner: "oa"})
	require.NoError(t, err)
	require.EqualValues(t, 1, again.Token, "the repeat gets the grant back")
}

// A batch whose reply is lost (the connection breaks after the batch
// reached the server) leaves every member indeterminate, never sent
// again; each repeat by the same owner gets its grant back with the same
// token.
func TestGroupCommitLostReply(t *testing.T) {
	t.Parallel()
	b, p, direct := proxied(t)
	coalesceAlways(b)
	ctx := testCtx(t)
	_, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "warm", TTL: time.Minute, Owner: "o"})
	require.NoError(t, err)

	holdQueue(b)
	keys := []string{"a", "b", "c"}
	var chs []chan acquireResult
	for i, k := range keys {
		chs = append(chs, goAcquire(ctx, b, sqllock.AcquireRequest{Key: k, TTL: time.Minute, Owner: "lost/" + k}))
		waitQueued(t, b, i+1)
	}
	p.BlackholeRepliesAfter([]byte("lost/"))
	flushQueue(b)
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, direct.QueryRowContext(ctx, "SELECT count(*) FROM "+quotedTable(b)+" WHERE owner LIKE 'lost/%' AND held").Scan(&n))
		return n == len(keys)
	}, 10*time.Second, 5*time.Millisecond, "the batch was applied")
	p.Reset()
	p.Pass()
	for _, ch := range chs {
		r := recv(t, ch)
		require.ErrorIs(t, r.err, sqllock.ErrIndeterminate)
	}
	unholdQueue(t, b)
	require.Zero(t, b.acquireQ.Alone(), "members of a batch of unknown outcome were sent again")
	for _, k := range keys {
		l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: k, TTL: time.Minute, Owner: "lost/" + k})
		require.NoError(t, err)
		require.EqualValues(t, 1, l.Token, "the repeat of %s gets its grant back", k)
	}
}

// A batch that InnoDB rolls back as a deadlock's victim (1213) applied
// nothing and is repeated whole, as the single statement is: every member
// gets its answer from the repeat.
func TestGroupCommitDeadlockRepeated(t *testing.T) {
	// Not parallel: it reads the server's lock waits.
	b, db := newBackend(t)
	coalesceAlways(b)
	ctx := testCtx(t)
	for _, k := range []string{"a", "b"} {
		l, err := b.tryAcquire(ctx, sqllock.AcquireRequest{Key: k, TTL: time.Minute, Owner: "setup"})
		require.NoError(t, err)
		require.NoError(t, b.Release(ctx, l))
	}
	_, err := db.ExecContext(ctx, "CREATE TABLE heavy (id INT PRIMARY KEY, n INT NOT NULL)")
	require.NoError(t, err)
	_, err = db.ExecContext(ctx, "INSERT INTO heavy SELECT seq, 0 FROM seq_1_to_2000")
	require.NoError(t, err)

	// A transaction that has changed many rows (so that InnoDB picks the
	// batch as the victim) holds b; the batch takes a, then waits for b;
	// the transaction then asks for a: a deadlock.
	tx, err := db.BeginTx(ctx, nil)
	require.NoError(t, err)
	defer tx.Rollback()
	_, err = tx.ExecContext(ctx, "UPDATE heavy SET n = n + 1")
	require.NoError(t, err)
	_, err = tx.ExecContext(ctx, "UPDATE "+quotedTable(b)+" SET owner = owner WHERE `key` = 'b'")
	require.NoError(t, err)

	holdQueue(b)
	ra := goAcquire(ctx, b, sqllock.AcquireRequest{Key: "a", TTL: time.Minute, Owner: "o"})
	waitQueued(t, b, 1)
	rb := goAcquire(ctx, b, sqllock.AcquireRequest{Key: "b", TTL: time.Minute, Owner: "o"})
	waitQueued(t, b, 2)
	flushQueue(b)
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, db.QueryRowContext(ctx, "SELECT count(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT' AND trx_query LIKE '%JSON_TABLE%'").Scan(&n))
		return n == 1
	}, 10*time.Second, 200*time.Millisecond, "the batch waits for b") // the server refreshes innodb_trx only when it was not read for 100 ms
	_, err = tx.ExecContext(ctx, "UPDATE "+quotedTable(b)+" SET owner = owner WHERE `key` = 'a'")
	require.NoError(t, err, "the transaction was chosen as the victim, not the batch")
	require.NoError(t, tx.Commit())
	a, bb := recv(t, ra), recv(t, rb)
	unholdQueue(t, b)
	require.NoError(t, a.err)
	require.NoError(t, bb.err)
	require.EqualValues(t, 2, a.l.Token)
	require.EqualValues(t, 2, bb.l.Token)
	require.GreaterOrEqual(t, b.Stats().Deadlocks, uint64(1))
	require.EqualValues(t, 1, b.acquireQ.Batches())
	require.Zero(t, b.acquireQ.Alone(), "the batch was repeated whole, not member by member")
}

// Without concurrency nothing is coalesced: each acquire is the single
// statement, sent at once; and DisableGroupCommit turns it off.
func TestGroupCommitIdleSendsAlone(t *testing.T) {
	t.Parallel()
	b, db := newBackend(t)
	require.Equal(t, groupCommitInFlight, b.acquireQ.Limit, "on by default")
	require.Equal(t, groupCommitCalls, b.acquireQ.Calls, "batches only beyond groupCommitCalls outstanding acquires")
	require.Equal(t, groupCommitCalls, b.releaseQ.Calls, "batches only beyond groupCommitCalls outstanding releases")
	for i := range 5 {
		l, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: fmt.Sprint("k", i), TTL: time.Minute, Owner: "o"})
		require.NoError(t, err)
		require.NoError(t, b.Release(testCtx(t), l))
	}
	require.Zero(t, b.acquireQ.Batches())
	require.Zero(t, b.releaseQ.Batches())
	require.Zero(t, b.acquireQ.Sending())
	require.Zero(t, b.releaseQ.Sending())
	off, err := New(db, Options{DisableGroupCommit: true})
	require.NoError(t, err)
	defer off.Close()
	require.Zero(t, off.acquireQ.Limit)
	require.Zero(t, off.releaseQ.Limit)
}

// Many goroutines acquire and release a few keys through coalescing: no
// two holders of a key ever overlap (a holder marks the key in memory from
// its grant until just before its release is sent), and each key's
// tokens strictly increase from one grant to the next.
func TestGroupCommitHistory(t *testing.T) {
	t.Parallel()
	b, _ := newBackend(t)
	coalesceAlways(b)
	ctx := testCtx(t)
	keys := []string{"h0", "h1", "h2", "h3", "h4", "h5"}
	var (
		mu      sync.Mutex
		holder  = map[string]string{}
		last    = map[string]int64{}
		grants  atomic.Int64
		wg      sync.WaitGroup
		failure atomic.Value
	)
	fail := func(err error) { failure.CompareAndSwap(nil, err) }
	for g := range 12 {
		wg.Go(func() {
			for i := range 40 {
				owner := fmt.Sprintf("g%d-%d", g, i)
				key := keys[rand.N(len(keys))]
				l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: owner})
				if errors.Is(err, sqllock.ErrNotAcquired) {
					continue
				}
				if err != nil {
					fail(err)
					return
				}
				mu.Lock()
				if h, ok := holder[key]; ok {
					fail(fmt.Errorf("%s granted to %s while %s holds it", key, owner, h))
				}
				if l.Token <= last[key] {
					fail(fmt.Errorf("%s: token %d after %d", key, l.Token, last[key]))
				}
				holder[key], last[key] = owner, l.Token
				mu.Unlock()
				grants.Add(1)
				mu.Lock()
				delete(holder, key)
				mu.Unlock()
				if err := b.Release(ctx, l); err != nil {
					fail(err)
					return
				}
			}
		})
	}
	wg.Wait()
	if err, ok := failure.Load().(error); ok {
		t.Fatal(err)
	}
	require.Positive(t, b.acquireQ.Batches(), "no acquire was coalesced")
	require.Positive(t, b.releaseQ.Batches(), "no release was coalesced")
	t.Logf("%d grants, %d batches of acquires, %d of releases, %d sent alone by a batch",
		grants.Load(), b.acquireQ.Batches(), b.releaseQ.Batches(), b.acquireQ.Alone()+b.releaseQ.Alone())
}

// The answers of one batch of releases are those of the same releases
// sent alone (releaseHeldSQL, then releaseSQL when it cleared nothing) on
// a database in the same state: a held lease (nil), an expired one
// (expired), a stale token (taken), a lease released already by its
// owner (nil), a forced release by another owner (nil), a release inside
// the min hold (nil, the key stays taken), a key never granted (absent
// from the batch's reply: sent alone); and the rows the two leave are
// the same.
func TestGroupCommitReleaseAnswersAsAlone(t *testing.T) {
	t.Parallel()
	const hold = 10 * time.Minute
	setup := func(t *testing.T, b *Backend, db *sql.DB) []sqllock.Lease {
		ctx := testCtx(t)
		get := func(req sqllock.AcquireRequest) sqllock.Lease {
			req.TTL = time.Minute
			l, err := b.tryAcquire(ctx, req)
			require.NoError(t, err)
			return l
		}
		held := get(sqllock.AcquireRequest{Key: "held", Owner: "o"})
		expired := get(sqllock.AcquireRequest{Key: "expired", Owner: "o"})
		expire(t, db, b, "expired")
		stale := get(sqllock.AcquireRequest{Key: "taken", Owner: "o"})
		expire(t, db, b, "taken")
		get(sqllock.AcquireRequest{Key: "taken", Owner: "newer"})
		twice := get(sqllock.AcquireRequest{Key: "twice", Owner: "o"})
		require.NoError(t, b.release(ctx, twice))
		forced := get(sqllock.AcquireRequest{Key: "forced", Owner: "holder"})
		forced.Owner = "admin"
		kept := get(sqllock.AcquireRequest{Key: "kept", Owner: "o", MinHold: hold})
		never := sqllock.Lease{Key: "never", Token: 1, Owner: "o"}
		return []sqllock.Lease{held, expired, stale, twice, forced, kept, never}
	}

	batched, bdb := newBackend(t)
	coalesceAlways(batched)
	leases := setup(t, batched, bdb)
	holdQ(batched.releaseQ)
	var chs []chan error
	for i, l := range leases {
		ch := make(chan error, 1)
		go func() { ch <- batched.Release(testCtx(t), l) }()
		chs = append(chs, ch)
		waitQ(t, batched.releaseQ, i+1)
	}
	batched.releaseQ.Flush()
	got := make([]error, len(chs))
	for i, ch := range chs {
		got[i] = recv(t, ch)
	}
	unholdQ(t, batched.releaseQ)
	require.EqualValues(t, 1, batched.releaseQ.Batches(), "the releases went as one batch")
	require.EqualValues(t, 1, batched.releaseQ.Alone(), "only the key without a row was sent alone")

	alone, adb := newBackend(t)
	for i, l := range setup(t, alone, adb) {
		err := alone.release(testCtx(t), l)
		if err == nil {
			require.NoError(t, got[i], "%s", l.Key)
			continue
		}
		var want, have *sqllock.LostError
		require.ErrorAs(t, err, &want, "%s", l.Key)
		require.ErrorAs(t, got[i], &have, "%s: alone %v, batched %v", l.Key, err, got[i])
		require.Equal(t, want.Reason, have.Reason, "%s", l.Key)
		require.Equal(t, want.Token, have.Token, "%s", l.Key)
	}
	// A few answers spelled out, so that both cannot be wrong alike.
	require.NoError(t, got[0])
	var lost *sqllock.LostError
	require.ErrorAs(t, got[1], &lost)
	require.Equal(t, sqllock.LostExpired, lost.Reason)
	require.ErrorAs(t, got[2], &lost)
	require.Equal(t, sqllock.LostTaken, lost.Reason)

	bl, err := batched.List(testCtx(t), "")
	require.NoError(t, err)
	al, err := alone.List(testCtx(t), "")
	require.NoError(t, err)
	require.Len(t, bl, len(al))
	for i := range al {
		require.Equal(t, al[i].Key, bl[i].Key)
		require.Equal(t, al[i].Token, bl[i].Token, "%s", al[i].Key)
		require.Equal(t, al[i].Owner, bl[i].Owner, "%s", al[i].Key)
		require.Equal(t, al[i].Held, bl[i].Held, "%s", al[i].Key)
		require.InDelta(t, al[i].Remaining.Seconds(), bl[i].Remaining.Seconds(), 5, "%s", al[i].Key)
	}
	require.True(t, bl[3].Key == "kept" && bl[3].Held, "released inside its min hold: still taken (%+v)", bl[3])
}

// A batch carries keys, owners and values of the largest sizes allowed,
// multi-byte characters and all bytes included, without a byte changed.
func TestGroupCommitLargestInputs(t *testing.T) {
	t.Parallel()
	b, _ := newBackend(t)
	coalesceAlways(b)
	value := make([]byte, sqllock.MaxValueLen)
	for i := range value {
		value[i] = byte(i * 7)
	}
	reqs := []sqllock.AcquireRequest{
		{Key: strings.Repeat("é", sqllock.MaxKeyLen/2), Owner: strings.Repeat("ö", sqllock.MaxOwnerLen/2), Value: value},
		{Key: strings.Repeat("k", sqllock.MaxKeyLen), Owner: strings.Repeat("o", sqllock.MaxOwnerLen), Value: value[:1]},
	}
	for i := range reqs {
		reqs[i].TTL = time.Minute
	}
	res := acquireBatch(t, b, reqs...)
	require.EqualValues(t, 1, b.acquireQ.Batches())
	require.Zero(t, b.acquireQ.Alone())
	for i, r := range res {
		require.NoError(t, r.err)
		require.Equal(t, reqs[i].Owner, r.l.Owner)
		require.Equal(t, reqs[i].Value, r.l.Value)
		infos, err := b.List(testCtx(t), reqs[i].Key)
		require.NoError(t, err)
		require.Len(t, infos, 1)
		require.Equal(t, reqs[i].Key, infos[0].Key)
		require.Equal(t, reqs[i].Owner, infos[0].Owner)
		require.Equal(t, reqs[i].Value, infos[0].Value)
	}
	holdQ(b.releaseQ)
	var chs []chan error
	for i, r := range res {
		ch := make(chan error, 1)
		go func() { ch <- b.Release(testCtx(t), r.l) }()
		chs = append(chs, ch)
		waitQ(t, b.releaseQ, i+1)
	}
	b.releaseQ.Flush()
	for _, ch := range chs {
		require.NoError(t, recv(t, ch))
	}
	unholdQ(t, b.releaseQ)
	require.EqualValues(t, 1, b.releaseQ.Batches())
	require.Zero(t, b.releaseQ.Alone())
	infos, err := b.List(testCtx(t), "")
	require.NoError(t, err)
	for _, i := range infos {
		require.False(t, i.Held, "%s", i.Key)
	}
}

// A batch of releases whose reply is lost leaves every member
// indeterminate, as the single release's lost reply; repeating each is
// harmless.
func TestGroupCommitReleaseLostReply(t *testing.T) {
	t.Parallel()
	b, p, direct := proxied(t)
	coalesceAlways(b)
	ctx := testCtx(t)
	var leases []sqllock.Lease
	for _, k := range []string{"a", "b", "c"} {
		l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: k, TTL: time.Minute, Owner: "lostrel/" + k})
		require.NoError(t, err)
		leases = append(leases, l)
	}
	holdQ(b.releaseQ)
	var chs []chan error
	for i, l := range leases {
		ch := make(chan error, 1)
		go func() { ch <- b.Release(ctx, l) }()
		chs = append(chs, ch)
		waitQ(t, b.releaseQ, i+1)
	}
	p.BlackholeRepliesAfter([]byte("lostrel/"))
	b.releaseQ.Flush()
	require.Eventually(t, func() bool {
		var n int
		require.NoError(t, direct.QueryRowContext(ctx, "SELECT count(*) FROM "+quotedTable(b)+" WHERE owner LIKE 'lostrel/%' AND NOT held").Scan(&n))
		return n == len(leases)
	}, 10*time.Second, 5*time.Millisecond, "the batch was applied")
	p.Reset()
	p.Pass()
	for _, ch := range chs {
		require.ErrorIs(t, recv(t, ch), sqllock.ErrIndeterminate)
	}
	unholdQ(t, b.releaseQ)
	require.Zero(t, b.releaseQ.Alone(), "members of a batch of unknown outcome were sent again")
	for _, l := range leases {
		require.NoError(t, b.Release(ctx, l), "repeating a release that was applied is harmless")
	}
}
