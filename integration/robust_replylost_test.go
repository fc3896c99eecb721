package integration

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// grantsOf returns the distinct tokens the audit log granted to owner.
func (w *robustWorld) grantsOf(ctx context.Context, owner string) []int64 {
	t := w.t
	t.Helper()
	rows, err := w.db.Pool.Query(ctx, "SELECT DISTINCT token FROM robust_audit WHERE owner = $1 AND kind = 'acquire' ORDER BY token", owner)
	require.NoError(t, err)
	defer rows.Close()
	var out []int64
	for rows.Next() {
		var tok int64
		require.NoError(t, rows.Scan(&tok))
		out = append(out, tok)
	}
	require.NoError(t, rows.Err())
	return out
}

// TestRobustReplyLostAfterCommit is PG-4: the reply to A's acquire is
// lost after the grant committed. At the backend, A gets ErrIndeterminate
// and the audit log shows the grant; B cannot acquire before it expires; A's
// retry with the same owner gets the same token back, never a second
// tenure. Through the Client, the outcome is the same tenure (settled) or
// ErrIndeterminate, with one token at most.
//
// Nothing here waits for a lease to expire, so the TTL is long (10s): the
// orphan grant must stay unexpired through B's attempt and A's retry, however
// slow the machine. Each blackholed call waits out its context (replyWait):
// it must cover the request's way to the database, A's pool being warm.
func TestRobustReplyLostAfterCommit(t *testing.T) {
	t.Parallel()
	const replyWait = 2 * time.Second
	w := newRobustWorld(t, "PG-4", 0, 10*time.Second, robustParams)
	ctx, cancel := context.WithTimeout(t.Context(), 40*time.Second)
	defer cancel()
	a, b := w.client(true, robustOpts()), w.client(false, robustOpts())

	// Warm A's pool before the blackhole is armed: a connection through
	// the proxy, started, with the acquire statement prepared. (Without
	// it the context below also covers dial, startup and prepare; if it ran
	// out before the request was sent, the outcome would be Unavailable and
	// nothing matched.)
	warm, err := a.fb.TryAcquire(ctx, sqllock.AcquireRequest{Key: "pg4-warm", TTL: w.ttl, Owner: "pg4-warm/1"})
	require.NoError(t, err)
	require.NoError(t, a.fb.Release(ctx, warm))

	// At the backend.
	const key = "pg4"
	req := sqllock.AcquireRequest{Key: key, TTL: w.ttl, Owner: "pg4-a/1"}
	a.proxy.BlackholeRepliesAfter([]byte(req.Owner))
	actx, acancel := context.WithTimeout(ctx, replyWait)
	_, err = a.fb.TryAcquire(actx, req)
	acancel()
	require.ErrorIs(t, err, sqllock.ErrIndeterminate)
	require.Equal(t, 1, a.proxy.Stats().Matched)
	a.proxy.Pass()
	tokens := w.grantsOf(ctx, req.Owner)
	require.Len(t, tokens, 1, "the grant committed although its reply was lost")
	_, err = b.c.TryAcquire(ctx, key, nil)
	require.ErrorIs(t, err, sqllock.ErrNotAcquired, "B acquired while the orphan grant is unexpired")
	l, err := a.fb.TryAcquire(ctx, req) // the retry: same owner
	require.NoError(t, err)
	require.Equal(t, tokens[0], l.Token, "a retry with the same owner must get the same tenure")
	require.NoError(t, a.fb.Release(ctx, l))
	gb, _, err := w.hold(ctx, b, key, 0, true)
	require.NoError(t, err)
	require.Equal(t, tokens[0]+1, gb.Token())
	require.NoError(t, gb.Release(ctx))

	// Through the Client: it settles a lost reply by repeating the request.
	// (A's pool is warm again: the retry and the release above ran on a
	// new connection through the proxy.)
	const key2 = "pg4-client"
	a.proxy.BlackholeRepliesAfter([]byte(key2))
	cctx, ccancel := context.WithTimeout(ctx, replyWait)
	g, err := a.c.TryAcquire(cctx, key2, nil)
	ccancel()
	outcome := "settled"
	if err != nil {
		require.True(t, errors.Is(err, sqllock.ErrIndeterminate) || errors.Is(err, context.DeadlineExceeded), "%v", err)
		outcome = "indeterminate"
		if strings.Contains(err.Error(), "settled and released") {
			outcome = "settled_after_deadline_and_released"
		}
	} else {
		require.NoError(t, g.Release(ctx))
	}
	a.proxy.Pass()
	var owners []string
	rows, err := w.db.Pool.Query(ctx, "SELECT DISTINCT owner FROM robust_audit WHERE key = $1 AND kind = 'acquire'", key2)
	require.NoError(t, err)
	for rows.Next() {
		var o string
		require.NoError(t, rows.Scan(&o))
		owners = append(owners, o)
	}
	require.NoError(t, rows.Err())
	require.Len(t, owners, 1, "one acquire call, one owner")
	require.Len(t, w.grantsOf(ctx, owners[0]), 1, "one acquire call must never give two tenures")

	h, r := w.check(ctx, "go test ./integration -run '^TestRobustReplyLostAfterCommit$' -v")
	indeterminate := 0
	for _, op := range h.Ops {
		if op.Outcome.Unknown() {
			indeterminate++
		}
	}
	faults := map[string]int{"reply_lost": a.proxy.Stats().Matched}
	t.Log(w.figures("TestRobustReplyLostAfterCommit", h, r, faults,
		fmt.Sprintf("indeterminate=%d resolved_via_audit=%d client_outcome=%s", indeterminate, len(tokens), outcome)))
	robustRequireFired(t, faults)
}

// TestRobustFencedCommitReplyLost is PG-4 for FencedTx (pgx#2110): the
// reply to the COMMIT of a fenced transaction is lost after the server
// committed. FencedTx must say the outcome is unknown (ErrIndeterminate),
// never report a failure for a write that was applied.
func TestRobustFencedCommitReplyLost(t *testing.T) {
	t.Parallel()
	const replyWait = 2 * time.Second
	w := newRobustWorld(t, "PG-4-fenced", 0, 10*time.Second, robustParams)
	ctx, cancel := context.WithTimeout(t.Context(), 40*time.Second)
	defer cancel()
	a := w.client(true, robustOpts())
	_, err := w.db.Pool.Exec(ctx, `CREATE TABLE fenced_data (id int PRIMARY KEY, fence bigint NOT NULL)`)
	require.NoError(t, err)

	l, err := a.be.TryAcquire(ctx, sqllock.AcquireRequest{Key: "pg4-fenced", TTL: w.ttl, Owner: "pg4-fenced/1"})
	require.NoError(t, err)
	// Warm: the fenced statement prepared on A's connection, so that only
	// the COMMIT below can match.
	require.NoError(t, a.be.FencedTx(ctx, l, func(pgx.Tx) error { return nil }))

	a.proxy.BlackholeRepliesAfter([]byte("commit"))
	fctx, fcancel := context.WithTimeout(ctx, replyWait)
	err = a.be.FencedTx(fctx, l, func(tx pgx.Tx) error {
		_, err := tx.Exec(fctx, `INSERT INTO fenced_data VALUES (1, $1)`, l.Token)
		return err
	})
	fcancel()
	require.Equal(t, 1, a.proxy.Stats().Matched, "the COMMIT was not seen by the proxy")
	a.proxy.Pass()
	require.ErrorIs(t, err, sqllock.ErrIndeterminate, "%v", err)
	var fence int64
	require.NoError(t, w.db.Pool.QueryRow(ctx, `SELECT fence FROM fenced_data WHERE id = 1`).Scan(&fence),
		"the commit was applied although its reply was lost")
	require.Equal(t, l.Token, fence)
	t.Logf("RESULT test=TestRobustFencedCommitReplyLost backend=postgres commit_reply_lost=1 reported=%q applied=1", err)
}
