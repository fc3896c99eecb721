package etcd

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ashlock/ashlock/dialect/etcd/internal/etcdtest"
	"github.com/ashlock/ashlock/sqllock"
)

// slowTxns makes every transaction's reply come 30 ms late, so that
// concurrent calls queue for batches, and records the errors the
// transactions got.
func slowTxns(b *Backend, calls interface {
	SetFail(func(string, error) error)
}) func() []error {
	return slowTxnsBy(calls, 30*time.Millisecond)
}

// slowTxnsBy is slowTxns with replies d late.
func slowTxnsBy(calls interface {
	SetFail(func(string, error) error)
}, d time.Duration) func() []error {
	return slowTxnsAfterGrants(calls, d, 0)
}

// slowTxnsAfterGrants is slowTxnsBy that also holds the replies of the
// first grants etcd leases until all of them have come (or 10 s passed),
// so that the acquires sending them reach the queue together: without
// it, on a loaded machine, their grants' latencies spread them over more
// than a transaction's time, and too few queue up to share one.
func slowTxnsAfterGrants(calls interface {
	SetFail(func(string, error) error)
}, d time.Duration, grants int) func() []error {
	var mu sync.Mutex
	var errs []error
	granted := 0
	together := make(chan struct{})
	if grants == 0 {
		close(together)
	}
	calls.SetFail(func(method string, err error) error {
		if method == "LeaseGrant" {
			mu.Lock()
			granted++
			if granted == grants {
				close(together)
			}
			mu.Unlock()
			select {
			case <-together:
			case <-time.After(10 * time.Second):
			}
		}
		if method == "Txn" {
			time.Sleep(d)
			if err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}
		return err
	})
	return func() []error {
		mu.Lock()
		defer mu.Unlock()
		return errs
	}
}

// txnsTaken ends what slowTxnsAfterGrants set on calls, checks that no
// transaction failed, and returns how many were sent since the last Take,
// with calls' summary.
func txnsTaken(t *testing.T, calls *etcdtest.Calls, txnErrs func() []error) (int, string) {
	t.Helper()
	_, by := calls.Take()
	calls.SetFail(nil)
	require.Empty(t, txnErrs())
	var txns int
	_, err := fmt.Sscanf(by[strings.Index(by, "Txn×"):], "Txn×%d", &txns)
	require.NoError(t, err, by)
	return txns, by
}

// releaseAll releases ls concurrently and returns their errors.
func releaseAll(ctx context.Context, b *Backend, ls []sqllock.Lease) []error {
	errs := make([]error, len(ls))
	var wg sync.WaitGroup
	for i, l := range ls {
		wg.Go(func() { errs[i] = b.Release(ctx, l) })
	}
	wg.Wait()
	return errs
}

// TestReleaseGroupCommit: concurrent releases share transactions (nested,
// one per release), with the single release's answers: each holder key
// gone, each release recorded (the owner's repeat is nil, a renewal is
// LostReleased), and the leases that expired before their release
// reported LostExpired (their nested transactions failed, and they were
// sent again alone).
func TestReleaseGroupCommit(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	const n = 24
	var ls []sqllock.Lease
	for i := range n {
		l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: fmt.Sprintf("k%d", i), TTL: 10 * time.Second, Owner: "o"})
		require.NoError(t, err)
		ls = append(ls, l)
	}
	gone := func(key string) bool { return key == "k3" || key == "k11" || key == "k17" || key == "k23" }
	for _, l := range ls {
		if gone(l.Key) {
			expire(t, b, l.Key)
		}
	}
	txnErrs := slowTxns(b, calls)
	calls.Take()
	errs := releaseAll(ctx, b, ls)
	total, by := calls.Take()
	calls.SetFail(nil)
	require.Less(t, total, n-4, "batched: %s", by)
	require.Empty(t, txnErrs())
	for i, l := range ls {
		if gone(l.Key) {
			var le *sqllock.LostError
			require.True(t, errors.As(errs[i], &le), "%v", errs[i])
			require.Equal(t, sqllock.LostExpired, le.Reason)
			continue
		}
		require.NoError(t, errs[i], l.Key)
		require.Zero(t, holderLease(t, b, l.Key), l.Key)
		require.NoError(t, b.Release(ctx, l), "%s: the owner's repeat", l.Key)
		_, err := b.TryRenew(ctx, l, 10*time.Second)
		var le *sqllock.LostError
		require.True(t, errors.As(err, &le), "%v", err)
		require.Equal(t, sqllock.LostReleased, le.Reason, l.Key)
	}
}

// TestReleaseBatchOneKeyOnce: two releases of one key queued together go
// in two batches (etcd refuses a transaction that writes a key twice);
// each gets the single release's answer.
func TestReleaseBatchOneKeyOnce(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	var ls []sqllock.Lease
	for i := range 12 {
		l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: fmt.Sprintf("k%d", i), TTL: 10 * time.Second, Owner: "o"})
		require.NoError(t, err)
		ls = append(ls, l, l) // every release twice
	}
	txnErrs := slowTxns(b, calls)
	errs := releaseAll(ctx, b, ls)
	calls.SetFail(nil)
	require.Empty(t, txnErrs(), "a batch etcd refused")
	for i, err := range errs {
		require.NoError(t, err, ls[i].Key)
		require.Zero(t, holderLease(t, b, ls[i].Key))
	}
}

// TestReleaseBatchWithinMaxTxnOps: a queue longer than a transaction may
// hold (etcd's --max-txn-ops, 128 by default) goes in several batches,
// none of which etcd refuses.
func TestReleaseBatchWithinMaxTxnOps(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	var ls []sqllock.Lease
	for i := range DefaultMaxTxnOps + 20 {
		l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: fmt.Sprintf("k%d", i), TTL: 10 * time.Second, Owner: "o"})
		require.NoError(t, err)
		ls = append(ls, l)
	}
	txnErrs := slowTxnsBy(calls, 300*time.Millisecond) // all queued before the first batch
	errs := releaseAll(ctx, b, ls)
	calls.SetFail(nil)
	require.Empty(t, txnErrs(), "a batch etcd refused")
	for i, err := range errs {
		require.NoError(t, err, ls[i].Key)
	}
}

// TestReleaseQueuedCancelledNotSent: a release whose context ends while
// it waits in the queue is never sent: it says so, and the key stays
// held.
func TestReleaseQueuedCancelledNotSent(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	var ls []sqllock.Lease
	for i := range groupInFlight + 3 {
		l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: fmt.Sprintf("k%d", i), TTL: 10 * time.Second, Owner: "o"})
		require.NoError(t, err)
		ls = append(ls, l)
	}
	calls.SetFail(func(method string, err error) error {
		if method == "Txn" {
			time.Sleep(150 * time.Millisecond)
		}
		return err
	})
	var wg sync.WaitGroup
	for _, l := range ls[:groupInFlight] {
		wg.Go(func() { require.NoError(t, b.Release(ctx, l)) })
	}
	time.Sleep(30 * time.Millisecond) // both in flight
	// Two more queue behind them, for a batch.
	for _, l := range ls[groupInFlight+1:] {
		wg.Go(func() { require.NoError(t, b.Release(ctx, l)) })
	}
	qctx, cancel := context.WithTimeout(ctx, 30*time.Millisecond)
	defer cancel()
	err := b.Release(qctx, ls[groupInFlight])
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.Contains(t, err.Error(), "not sent")
	wg.Wait()
	calls.SetFail(nil)
	require.NotZero(t, holderLease(t, b, ls[groupInFlight].Key), "the queued release was sent after all")
	for _, l := range ls[groupInFlight+1:] {
		require.Zero(t, holderLease(t, b, l.Key), l.Key)
	}
}

// TestReleaseBatchLostReply: a batch whose reply is lost (it was applied)
// leaves every member's outcome unknown, as the single release's lost
// reply: each gets an error, none is sent again behind the caller's back
// as if nothing had been applied; the owner's repeat then finds it
// released.
func TestReleaseBatchLostReply(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	var ls []sqllock.Lease
	for i := range groupInFlight + 4 {
		l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: fmt.Sprintf("k%d", i), TTL: 10 * time.Second, Owner: "o"})
		require.NoError(t, err)
		ls = append(ls, l)
	}
	var mu sync.Mutex
	lost := 0
	calls.SetFail(func(method string, err error) error {
		if method != "Txn" {
			return err
		}
		time.Sleep(30 * time.Millisecond)
		mu.Lock()
		defer mu.Unlock()
		if lost < groupInFlight+1 { // the releases sent alone, and the batch of the others
			lost++
			return status.Error(codes.Unavailable, "reply lost")
		}
		return err
	})
	errs := releaseAll(ctx, b, ls)
	calls.SetFail(nil)
	for i, err := range errs {
		require.Error(t, err, ls[i].Key)
		require.NotContains(t, err.Error(), "not sent")
		require.Zero(t, holderLease(t, b, ls[i].Key), "%s: applied", ls[i].Key)
		require.NoError(t, b.Release(ctx, ls[i]), "%s: the owner's repeat", ls[i].Key)
	}
}

// acquireAll acquires reqs concurrently and returns their leases and
// errors.
func acquireAll(ctx context.Context, b *Backend, reqs []sqllock.AcquireRequest) ([]sqllock.Lease, []error) {
	ls := make([]sqllock.Lease, len(reqs))
	errs := make([]error, len(reqs))
	var wg sync.WaitGroup
	for i, req := range reqs {
		wg.Go(func() { ls[i], errs[i] = b.TryAcquire(ctx, req) })
	}
	wg.Wait()
	return ls, errs
}

// TestAcquireGroupCommit: concurrent grants share transactions (nested,
// one per grant), with the single acquire's answers: a free key granted
// with the next token; a key held elsewhere refused, naming its holder
// (the nested transaction failed, and the acquire was sent again alone);
// a key granted and released elsewhere since this Backend saw it granted
// with the token after that one.
func TestAcquireGroupCommit(t *testing.T) {
	t.Parallel()
	b, calls, other := counted(t)
	ctx := testCtx(t)
	const n = 24
	held := func(i int) bool { return i%5 == 1 }
	changed := func(i int) bool { return i%5 == 3 }
	var reqs []sqllock.AcquireRequest
	for i := range n {
		key := fmt.Sprintf("k%02d", i)
		reqs = append(reqs, sqllock.AcquireRequest{Key: key, TTL: 10 * time.Second, Owner: "o"})
		if held(i) || changed(i) {
			ol, err := other.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: 10 * time.Second, Owner: "x"})
			require.NoError(t, err)
			if changed(i) {
				require.NoError(t, other.Release(ctx, ol))
			}
		}
	}
	txnErrs := slowTxnsAfterGrants(calls, 30*time.Millisecond, n)
	calls.Take()
	ls, errs := acquireAll(ctx, b, reqs)
	txns, by := txnsTaken(t, calls, txnErrs)
	// Alone, the n grants take n transactions, and the changed keys one
	// more each (29); batched, 4 go alone, the rest share one or two, and
	// the held and changed keys' failed nested grants go again alone
	// (about 15, and 20 once on a loaded CI machine).
	require.Less(t, txns, n, "batched: %s", by)
	for i, req := range reqs {
		switch {
		case held(i):
			var he *sqllock.HeldError
			require.True(t, errors.As(errs[i], &he), "%s: %v", req.Key, errs[i])
			require.Equal(t, "x", he.Owner)
		case changed(i):
			require.NoError(t, errs[i], req.Key)
			require.Equal(t, int64(2), ls[i].Token, req.Key)
		default:
			require.NoError(t, errs[i], req.Key)
			require.Equal(t, int64(1), ls[i].Token, req.Key)
			require.Equal(t, 10*time.Second, ls[i].Deadline.Sub(ls[i].BackendTime))
		}
		if errs[i] == nil {
			heldBy(t, other, req.Key, "o", ls[i].Token)
		}
	}
}

// TestAcquireGroupOneKeyOnce: two owners' acquires of one key queued
// together go in two batches (etcd refuses a transaction that writes a
// key twice): one is granted, the other refused, as single acquires.
func TestAcquireGroupOneKeyOnce(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	var reqs []sqllock.AcquireRequest
	for i := range 12 {
		for _, owner := range []string{"a", "b"} {
			reqs = append(reqs, sqllock.AcquireRequest{Key: fmt.Sprintf("k%d", i), TTL: 10 * time.Second, Owner: owner})
		}
	}
	txnErrs := slowTxns(b, calls)
	_, errs := acquireAll(ctx, b, reqs)
	calls.SetFail(nil)
	require.Empty(t, txnErrs(), "a batch etcd refused")
	for i := 0; i < len(reqs); i += 2 {
		granted := 0
		for _, err := range errs[i : i+2] {
			if err == nil {
				granted++
			} else {
				require.ErrorIs(t, err, sqllock.ErrNotAcquired)
			}
		}
		require.Equal(t, 1, granted, reqs[i].Key)
	}
}

// TestAcquireGroupWithinMaxTxnOps: a queue of grants longer than a
// transaction may hold goes in several batches, none of which etcd
// refuses.
func TestAcquireGroupWithinMaxTxnOps(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	var reqs []sqllock.AcquireRequest
	for i := range DefaultMaxTxnOps + 20 {
		reqs = append(reqs, sqllock.AcquireRequest{Key: fmt.Sprintf("k%d", i), TTL: 10 * time.Second, Owner: "o"})
	}
	txnErrs := slowTxnsBy(calls, 300*time.Millisecond) // all queued before the first batch
	_, errs := acquireAll(ctx, b, reqs)
	calls.SetFail(nil)
	require.Empty(t, txnErrs(), "a batch etcd refused")
	for i, err := range errs {
		require.NoError(t, err, reqs[i].Key)
	}
}

// TestSetGroupCommit: concurrent sets share transactions (nested, one per
// set, no key in two of a batch), with the single set's answers: free
// sets granted whole with the next tokens; a set with a key held
// elsewhere refused whole, naming it (the nested transaction failed, and
// the set was sent again alone, with its reads); a set with a key granted
// and released elsewhere since this Backend saw it granted with the token
// after that one. Alone, the 24 sets take 24 transactions and the changed
// ones one more each (28).
func TestSetGroupCommit(t *testing.T) {
	t.Parallel()
	b, calls, other := counted(t)
	ctx := testCtx(t)
	const n = 24
	held := func(i int) bool { return i%6 == 1 }
	changed := func(i int) bool { return i%6 == 3 }
	reqs := make([]sqllock.MultiAcquireRequest, n)
	for i := range n {
		reqs[i] = sqllock.MultiAcquireRequest{Keys: []string{fmt.Sprintf("s%02d-b", i), fmt.Sprintf("s%02d-a", i)}, TTL: 10 * time.Second, Owner: "o"}
		if held(i) || changed(i) {
			ol, err := other.TryAcquire(ctx, sqllock.AcquireRequest{Key: reqs[i].Keys[0], TTL: 10 * time.Second, Owner: "x"})
			require.NoError(t, err)
			if changed(i) {
				require.NoError(t, other.Release(ctx, ol))
			}
		}
	}
	// A set grants its keys' etcd leases one after the other: the first
	// of each set's grants waits for the others', so that the sets' Txns
	// come together.
	txnErrs := slowTxnsAfterGrants(calls, 30*time.Millisecond, n)
	calls.Take()
	sets := make([][]sqllock.Lease, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, req := range reqs {
		wg.Go(func() { sets[i], errs[i] = b.TryAcquireAll(ctx, req) })
	}
	wg.Wait()
	txns, by := txnsTaken(t, calls, txnErrs)
	t.Logf("%d transactions, %d set batches", txns, b.sets.Batches())
	require.Less(t, txns, n, "batched: %s", by)
	require.Positive(t, b.sets.Batches())
	for i, req := range reqs {
		switch {
		case held(i):
			var he *sqllock.HeldError
			require.True(t, errors.As(errs[i], &he), "%q: %v", req.Keys, errs[i])
			require.Equal(t, req.Keys[0], he.Key)
			require.Equal(t, "x", he.Owner)
			_, err := other.TryAcquire(ctx, sqllock.AcquireRequest{Key: req.Keys[1], TTL: 10 * time.Second, Owner: "y"})
			require.NoError(t, err, "a refused set took %s", req.Keys[1])
		case changed(i):
			require.NoError(t, errs[i], "%q", req.Keys)
			require.Equal(t, int64(2), sets[i][0].Token, req.Keys[0])
			require.Equal(t, int64(1), sets[i][1].Token, req.Keys[1])
		default:
			require.NoError(t, errs[i], "%q", req.Keys)
			for _, l := range sets[i] {
				require.Equal(t, int64(1), l.Token, l.Key)
			}
		}
		if errs[i] == nil {
			for _, l := range sets[i] {
				heldBy(t, other, l.Key, "o", l.Token)
			}
		}
	}
}

// TestPermitGroupCommit: concurrent permit acquires of distinct
// semaphores share transactions (nested, one per semaphore in a batch),
// with the single call's answers: a free permit granted with the next
// token; a semaphore whose only permit another Backend took since this
// one saw it refused, naming the holder (its chain's compares failed and
// it read the semaphore). Alone, the 24 acquires take 24 transactions and
// the taken ones one more each (28).
func TestPermitGroupCommit(t *testing.T) {
	t.Parallel()
	b, calls, other := counted(t)
	ctx := testCtx(t)
	const n = 24
	taken := func(i int) bool { return i%6 == 1 }
	reqs := make([]sqllock.PermitRequest, n)
	for i := range n {
		reqs[i] = sqllock.PermitRequest{AcquireRequest: sqllock.AcquireRequest{Key: fmt.Sprintf("sem%02d", i), TTL: 10 * time.Second, Owner: "o"}, Permits: 1}
		setup := reqs[i]
		setup.Owner = "setup"
		l, err := b.TryAcquirePermit(ctx, setup)
		require.NoError(t, err)
		require.NoError(t, b.Release(ctx, l))
		if taken(i) {
			setup.Owner = "x"
			_, err := other.TryAcquirePermit(ctx, setup)
			require.NoError(t, err)
		}
	}
	// No spare etcd leases left by the setup: each acquire grants one,
	// and the grants wait for each other so that the Txns come together.
	b.mu.Lock()
	clear(b.spares)
	b.mu.Unlock()
	txnErrs := slowTxnsAfterGrants(calls, 30*time.Millisecond, n)
	calls.Take()
	ls := make([]sqllock.Lease, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, req := range reqs {
		wg.Go(func() { ls[i], errs[i] = b.TryAcquirePermit(ctx, req) })
	}
	wg.Wait()
	txns, by := txnsTaken(t, calls, txnErrs)
	t.Logf("%d transactions, %d permit batches", txns, b.permits.Batches())
	require.Less(t, txns, n, "batched: %s", by)
	for i, req := range reqs {
		if taken(i) {
			var pe *sqllock.PermitsHeldError
			require.True(t, errors.As(errs[i], &pe), "%s: %v", req.Key, errs[i])
			require.Len(t, pe.Holders, 1)
			require.Equal(t, "x", pe.Holders[0].Owner)
			continue
		}
		require.NoError(t, errs[i], req.Key)
		require.Equal(t, sqllock.PermitKey(req.Key, 1), ls[i].Key)
		require.Equal(t, int64(2), ls[i].Token, req.Key)
		infos, err := other.List(ctx, ls[i].Key)
		require.NoError(t, err)
		require.Len(t, infos, 1)
		require.True(t, infos[0].Held, "List: %+v", infos[0])
		require.Equal(t, "o", infos[0].Owner)
		require.Equal(t, int64(2), infos[0].Token)
	}
}

// TestPermitGroupWithinMaxTxnOps: more concurrent permit acquires than a
// transaction may hold go in several batches, each chain cut to what its
// batch leaves it (permitBatchDepth), and etcd refuses none.
func TestPermitGroupWithinMaxTxnOps(t *testing.T) {
	t.Parallel()
	b, calls, _ := counted(t)
	ctx := testCtx(t)
	n := DefaultMaxTxnOps + 20
	reqs := make([]sqllock.PermitRequest, n)
	for i := range n {
		// 64 permits: chains as long as the acquires in flight allow
		// alone, longer than a batch leaves room for.
		reqs[i] = sqllock.PermitRequest{AcquireRequest: sqllock.AcquireRequest{Key: fmt.Sprintf("sem%03d", i), TTL: 10 * time.Second, Owner: "setup"}, Permits: 64}
		l, err := b.TryAcquirePermit(ctx, reqs[i])
		require.NoError(t, err)
		require.NoError(t, b.Release(ctx, l))
		reqs[i].Owner = "o"
	}
	txnErrs := slowTxnsBy(calls, 300*time.Millisecond) // all queued before the first batch
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i, req := range reqs {
		wg.Go(func() { _, errs[i] = b.TryAcquirePermit(ctx, req) })
	}
	wg.Wait()
	calls.SetFail(nil)
	require.Empty(t, txnErrs(), "a batch etcd refused")
	require.Positive(t, b.permits.Batches())
	for i, err := range errs {
		require.NoError(t, err, reqs[i].Key)
	}
}
