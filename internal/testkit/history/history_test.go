package history_test

import (
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/ashlock/ashlock/internal/testkit/history"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const (
	s  = int64(time.Second)
	ms = int64(time.Millisecond)
	db = int64(946684800) * s // the database clock's epoch in these histories
)

// grant, renew and release build audit records.
func grant(seq int64, key, owner string, token, at, ttl int64) history.Audit {
	return history.Audit{Seq: seq, Kind: history.Acquire, Key: key, Owner: owner, Token: token, Outcome: history.OK,
		TTL: time.Duration(ttl), DBNow: db + at, Deadline: db + at + ttl, At: at}
}

func renew(seq int64, key string, token, at, ttl int64) history.Audit {
	return history.Audit{Seq: seq, Kind: history.Renew, Key: key, Token: token, Outcome: history.OK,
		TTL: time.Duration(ttl), DBNow: db + at, Deadline: db + at + ttl, At: at}
}

func release(seq int64, key string, token, at int64) history.Audit {
	return history.Audit{Seq: seq, Kind: history.Release, Key: key, Token: token, Outcome: history.OK, DBNow: db + at, At: at}
}

func TestCheckTokenCatchesRegressionAndReuse(t *testing.T) {
	t.Parallel()
	good := &history.History{Params: history.Params{TokenStep1: true}, Audit: []history.Audit{
		grant(1, "k", "a/1", 1, 0, 3*s),
		grant(2, "k", "a/1", 1, s, 3*s), // a retry of the same acquire
		release(3, "k", 1, 2*s),
		grant(4, "k", "b/1", 2, 3*s, 3*s),
	}}
	r := &history.Report{}
	history.CheckToken(good, r)
	require.Zero(t, r.Anomalies(), r.First())

	for name, audit := range map[string][]history.Audit{
		"Reset":   {grant(1, "k", "a/1", 1, 0, s), grant(2, "k", "c/1", 2, 2*s, s), release(3, "k", 2, 3*s), grant(4, "k", "b/1", 1, 4*s, s)},
		"Reused":  {grant(1, "k", "a/1", 1, 0, s), grant(2, "k", "b/1", 1, 2*s, s)},
		"Skipped": {grant(1, "k", "a/1", 1, 0, s), grant(2, "k", "b/1", 3, 2*s, s)},
	} {
		r := &history.Report{}
		history.CheckToken(&history.History{Params: history.Params{TokenStep1: true}, Audit: audit}, r)
		require.Equal(t, 1, r.Count(history.CToken), name)
	}

	// Two owners saw the same token.
	r = &history.Report{}
	history.CheckToken(&history.History{Ops: []history.Op{
		{ID: 1, Kind: history.Acquire, Key: "k", Owner: "a/1", Token: 7, Outcome: history.OK},
		{ID: 2, Kind: history.Acquire, Key: "k", Owner: "b/1", Token: 7, Outcome: history.OK},
	}}, r)
	require.Equal(t, 1, r.Count(history.CToken))
}

func TestCheckDBOverlapCatchesEarlyGrantAndStaleRenew(t *testing.T) {
	t.Parallel()
	good := &history.History{Audit: []history.Audit{
		grant(1, "k", "a/1", 1, 0, 3*s),
		renew(2, "k", 1, s, 3*s),          // deadline 4s
		grant(3, "k", "b/1", 2, 4*s, 3*s), // exactly at the deadline: expired
		release(4, "k", 2, 5*s),
		grant(5, "k", "c/1", 3, 5*s, 3*s), // right after a release
		{Seq: 6, Kind: history.Expire, Key: "k", DBNow: db + 6*s, Deadline: db + 6*s, At: 6 * s},
		grant(7, "k", "d/1", 4, 6*s, 3*s), // right after a forced expiry
	}}
	r := &history.Report{}
	history.CheckDBOverlap(good, r)
	require.Zero(t, r.Anomalies(), r.First())

	for name, audit := range map[string][]history.Audit{
		"GrantBeforeDeadline": {grant(1, "k", "a/1", 1, 0, 3*s), renew(2, "k", 1, s, 3*s), grant(3, "k", "b/1", 2, 3*s+999*ms, s)},
		"StaleRenew":          {grant(1, "k", "a/1", 1, 0, s), grant(2, "k", "b/1", 2, 2*s, s), renew(3, "k", 1, 2*s+ms, s)},
		"RenewRevivesExpired": {grant(1, "k", "a/1", 1, 0, s), renew(2, "k", 1, 2*s, s)},
	} {
		r := &history.Report{}
		history.CheckDBOverlap(&history.History{Audit: audit}, r)
		require.Equal(t, 1, r.Count(history.CDBOverlap), name)
	}
}

// lease is a guard with its successful acquire.
func lease(id int, key, owner string, token, start, end int64) (history.Guard, history.Op) {
	g := history.Guard{ID: id, Client: id, Key: key, Owner: owner, Token: token, TTL: 3 * time.Second,
		Margin: 300 * time.Millisecond, Start: start, End: end}
	op := history.Op{ID: id, Client: id, Kind: history.Acquire, Key: key, Owner: owner, Token: token,
		Call: start, Return: start, Outcome: history.OK}
	return g, op
}

func TestCheckGuard(t *testing.T) {
	t.Parallel()
	g1, a1 := lease(1, "k", "a/1", 1, 0, 2700*ms) // cancelled exactly at send + TTL - margin
	g2, a2 := lease(2, "k", "b/1", 2, 2700*ms, 4*s)
	r := &history.Report{}
	history.CheckGuard(&history.History{Guards: []history.Guard{g1, g2}, Ops: []history.Op{a1, a2}}, r)
	require.Zero(t, r.Anomalies(), r.First())

	t.Run("CancelledLate", func(t *testing.T) {
		g, a := lease(1, "k", "a/1", 1, 0, 2700*ms+1)
		r := &history.Report{}
		history.CheckGuard(&history.History{Guards: []history.Guard{g}, Ops: []history.Op{a}}, r)
		require.Equal(t, 1, r.Count(history.CGuard), r.First())
	})
	t.Run("Overlap", func(t *testing.T) {
		g1, a1 := lease(1, "k", "a/1", 1, 0, 2*s)
		g2, a2 := lease(2, "k", "b/1", 2, 2*s-1, 3*s)
		r := &history.Report{}
		history.CheckGuard(&history.History{Guards: []history.Guard{g1, g2}, Ops: []history.Op{a1, a2}}, r)
		require.Equal(t, 1, r.Count(history.CGuard), r.First())
	})
	t.Run("SharedToken", func(t *testing.T) {
		// Two clients handed the same grant (one owner name for both).
		g1, a1 := lease(1, "k", "web01/1", 1, 0, 2*s)
		g2, a2 := lease(2, "k", "web01/1", 1, s, 2*s)
		g2.Client = 1
		r := &history.Report{}
		history.CheckGuard(&history.History{Guards: []history.Guard{g1, g2}, Ops: []history.Op{a1, a2}}, r)
		require.Equal(t, 1, r.Count(history.CGuard), r.First())
	})
	t.Run("LossIgnored", func(t *testing.T) {
		g, a := lease(1, "k", "a/1", 1, 0, 2*s)
		lost := history.Op{ID: 2, Kind: history.Renew, Key: "k", Owner: "a/1", Token: 1, Call: s, Return: s, Outcome: history.Lost}
		r := &history.Report{}
		history.CheckGuard(&history.History{Guards: []history.Guard{g}, Ops: []history.Op{a, lost}}, r)
		require.Equal(t, 1, r.Count(history.CGuard), r.First())
	})
	t.Run("DocumentedCases", func(t *testing.T) {
		// A paused holder acting after its guard ended.
		g1, a1 := lease(1, "k", "a/1", 1, 0, 2*s)
		g1.Zombie, g1.BeliefEnd = true, 4*s
		g2, a2 := lease(2, "k", "b/1", 2, 3*s, 5*s)
		// A forced expiry of the next holder's lease.
		g3, a3 := lease(3, "k", "c/1", 3, 6*s, 8*s)
		g4, a4 := lease(4, "k", "d/1", 4, 7*s, 9*s)
		h := &history.History{
			Guards: []history.Guard{g1, g2, g3, g4}, Ops: []history.Op{a1, a2, a3, a4},
			Events: []history.Event{{Kind: history.EvExpire, Key: "k", At: 6500 * ms}},
		}
		r := &history.Report{}
		history.CheckGuard(h, r)
		require.Zero(t, r.Anomalies(), r.First())
		require.Equal(t, 1, r.PausedOverlaps)
		require.Equal(t, 1, r.ForcedOverlaps)
	})
}

func TestCheckFenceAndLostUpdate(t *testing.T) {
	t.Parallel()
	acc := func(key string, token int64, write, accepted, valid bool) history.Access {
		return history.Access{Key: key, Token: token, Write: write, Accepted: accepted, GuardValid: valid}
	}
	good := &history.History{Accesses: []history.Access{
		acc("k", 1, false, true, true),
		acc("k", 1, true, true, true),
		acc("k", 2, false, true, true),
		acc("k", 1, true, false, false), // a stale write, refused
		acc("k", 2, true, true, true),
	}, Final: map[string]int64{"k": 2}}
	r := history.Check(good)
	require.Zero(t, r.Anomalies(), r.First())
	require.Equal(t, 1, r.StaleAttempted)
	require.Equal(t, 1, r.StaleRejected)

	bad := &history.History{Accesses: []history.Access{
		acc("k", 2, true, true, true),
		acc("k", 1, true, true, false),  // stale, applied
		acc("k", 3, true, false, true),  // current, refused
		acc("k", 1, false, false, true), // a holder with a valid guard fenced out
	}, Final: map[string]int64{"k": 1}}
	r = history.Check(bad)
	require.Equal(t, 3, r.Count(history.CFence), r.First())
	require.Equal(t, 1, r.StaleApplied)
	require.Equal(t, 1, r.Count(history.CLostUpdate), "2 accepted increments, counter 1")
}

func TestCheckLive(t *testing.T) {
	t.Parallel()
	h := func(grantAt int64) *history.History {
		h := &history.History{
			Params: history.Params{Poll: 100 * time.Millisecond},
			Audit:  []history.Audit{grant(1, "k", "a/1", 1, 0, 3*s)},
			Events: []history.Event{{Kind: history.EvCrash, Client: 1, Key: "k", Token: 1, TTL: 3 * time.Second, At: s}},
			Waits:  []history.Wait{{Client: 2, Key: "k", Start: 500 * ms, End: 10 * s}},
		}
		if grantAt > 0 {
			h.Audit = append(h.Audit, grant(2, "k", "b/1", 2, grantAt, 3*s))
		}
		return h
	}
	r := &history.Report{}
	history.CheckLive(h(4*s+50*ms), r) // within crash + TTL + poll
	require.Zero(t, r.Anomalies(), r.First())
	require.Equal(t, 1, r.LiveObligations)

	for _, at := range []int64{4*s + 101*ms, 0} {
		r := &history.Report{}
		history.CheckLive(h(at), r)
		require.Equal(t, 1, r.Count(history.CLive), r.First())
	}

	// A waiter with a fault of its own owes nothing.
	hf := h(0)
	hf.Faults = []history.Fault{{Client: 2, Kind: "hang", At: 2 * s}}
	r = &history.Report{}
	history.CheckLive(hf, r)
	require.Zero(t, r.Anomalies())
	require.Zero(t, r.LiveObligations)
}

// op builds a client-visible call.
func op(id, client int, kind history.OpKind, owner string, token, call, ret int64, out history.Outcome, a *history.Audit) history.Op {
	o := history.Op{ID: id, Client: client, Kind: kind, Key: "k", Owner: owner, Token: token, TTL: 3 * time.Second,
		Call: call, Return: ret, Outcome: out}
	if kind == history.Release {
		o.TTL = 0
	}
	if a != nil {
		o.Audit = a.Seq
		if out == history.OK && kind != history.Release {
			o.DBNow, o.Deadline = a.DBNow, a.Deadline
		}
	}
	return o
}

func TestCheckLin(t *testing.T) {
	t.Parallel()
	g1 := grant(1, "k", "a/1", 1, s, 3*s)
	held := history.Audit{Seq: 2, Kind: history.Acquire, Key: "k", Owner: "b/1", Outcome: history.Held, DBNow: db + 2*s, At: 2 * s}
	rl := release(3, "k", 1, 3*s)
	g2 := grant(4, "k", "b/2", 2, 3*s+ms, 3*s)
	good := &history.History{Params: history.Params{TokenStep1: true},
		Audit: []history.Audit{g1, held, rl, g2},
		Ops: []history.Op{
			op(1, 0, history.Acquire, "a/1", 1, s, s, history.OK, &g1),
			op(2, 1, history.Acquire, "b/1", 0, 2*s, 2*s, history.Held, &held),
			op(3, 0, history.Release, "a/1", 1, 3*s, 3*s, history.OK, &rl),
			op(4, 1, history.Acquire, "b/2", 2, 3*s+ms, 3*s+ms, history.OK, &g2),
		}}
	r := &history.Report{}
	history.CheckLin(good, r, true, 10*time.Second)
	require.Equal(t, "Ok", r.Lin, r.First())

	// The release's reply was lost: an unknown outcome that the audit log
	// shows applied, so the next grant is legal.
	lost := *good
	lost.Ops = append([]history.Op(nil), good.Ops...)
	lost.Ops[2].Outcome = history.Indeterminate
	r = &history.Report{}
	history.CheckLin(&lost, r, true, 10*time.Second)
	require.Equal(t, "Ok", r.Lin, r.First())

	// Without the release, b's grant overlaps a's lease: illegal.
	bad := &history.History{Params: history.Params{TokenStep1: true}, Audit: []history.Audit{g1, g2},
		Ops: []history.Op{good.Ops[0], good.Ops[3]}}
	r = &history.Report{}
	history.CheckLin(bad, r, true, 10*time.Second)
	require.Equal(t, "Illegal", r.Lin)
	require.Equal(t, 1, r.Count(history.CLin))

	// A token that restarts after a release is illegal too.
	g3 := grant(4, "k", "b/2", 1, 3*s+ms, 3*s)
	reset := &history.History{Params: history.Params{TokenStep1: true}, Audit: []history.Audit{g1, rl, g3},
		Ops: []history.Op{good.Ops[0], good.Ops[2], op(4, 1, history.Acquire, "b/2", 1, 3*s+ms, 3*s+ms, history.OK, &g3)}}
	r = &history.Report{}
	history.CheckLin(reset, r, true, 10*time.Second)
	require.Equal(t, "Illegal", r.Lin)

	// A repeated release: harmless (OK) for whoever released, a loss for
	// anyone else (the holder after an operator's forced release).
	forced := func(second history.Op) *history.History {
		return &history.History{Params: history.Params{TokenStep1: true}, Audit: []history.Audit{g1, rl},
			Ops: []history.Op{good.Ops[0], op(3, 2, history.Release, "operator", 1, 3*s, 3*s, history.OK, &rl), second}}
	}
	for _, tc := range []struct {
		second history.Op
		want   string
	}{
		{op(5, 0, history.Release, "a/1", 1, 4*s, 4*s, history.Lost, nil), "Ok"},
		{op(5, 0, history.Release, "a/1", 1, 4*s, 4*s, history.OK, nil), "Illegal"},
		{op(5, 2, history.Release, "operator", 1, 4*s, 4*s, history.OK, nil), "Ok"},
		{op(5, 2, history.Release, "operator", 1, 4*s, 4*s, history.Lost, nil), "Illegal"},
	} {
		r = &history.Report{}
		history.CheckLin(forced(tc.second), r, true, 10*time.Second)
		require.Equal(t, tc.want, r.Lin, "second release by %s -> %v: %s", tc.second.Owner, tc.second.Outcome, r.First())
	}
}

func TestLinOperationsPatchesUnknownCalls(t *testing.T) {
	t.Parallel()
	g1 := grant(1, "k", "a/1", 1, 2*s, 3*s)
	h := &history.History{Audit: []history.Audit{g1}, Ops: []history.Op{
		op(1, 0, history.Acquire, "a/1", 0, s, 5*s, history.Indeterminate, &g1), // applied at 2s
		op(2, 1, history.Acquire, "b/1", 0, s, 5*s, history.Indeterminate, nil), // never applied
		op(3, 2, history.Renew, "c/1", 4, s, 5*s, history.Unavailable, nil),     // never applied
		op(4, 3, history.Acquire, "\x00", 0, s, s, history.Invalid, nil),        // refused before I/O
	}}
	ops := history.LinOperations(h, true)
	require.Len(t, ops, 1, "calls the audit log shows were never applied are dropped")
	require.Equal(t, 2*s, ops[0].Return, "an applied unknown call returns when the audit log says it took effect")
	ops = history.LinOperations(h, false)
	require.Len(t, ops, 3)
	require.Equal(t, int64(math.MaxInt64), ops[1].Return, "an unknown call the audit log cannot place returns at +inf")
}

func TestHashIgnoresRecordingOrder(t *testing.T) {
	t.Parallel()
	a := &history.History{Ops: []history.Op{{ID: 1, Key: "a", Call: 1}, {ID: 2, Key: "b", Call: 1}}}
	b := &history.History{Ops: []history.Op{{ID: 1, Key: "b", Call: 1}, {ID: 2, Key: "a", Call: 1}}}
	require.Equal(t, a.Hash(), b.Hash())
	b.Ops[0].Call = 2
	require.NotEqual(t, a.Hash(), b.Hash())
}

func TestResourceFences(t *testing.T) {
	t.Parallel()
	rec := history.NewRecorder("t", 0, history.Params{})
	res := history.NewResource(rec)
	v, ok := res.Read("k", 1, history.Access{})
	require.True(t, ok)
	require.True(t, res.Write("k", 1, v+1, history.Access{}))
	_, ok = res.Read("k", 2, history.Access{})
	require.True(t, ok)
	require.False(t, res.Write("k", 1, 5, history.Access{}), "token 1 is stale after token 2 read")
	_, ok = res.Read("k", 1, history.Access{})
	require.False(t, ok)
	res.Finish()
	h := rec.History()
	require.Equal(t, int64(1), h.Final["k"])
	r := history.Check(h)
	require.Zero(t, r.Anomalies(), r.First())
	require.Equal(t, 1, r.StaleRejected)
}

func TestLinkAudit(t *testing.T) {
	t.Parallel()
	g1 := grant(1, "k", "a/1", 1, s, 3*s)
	g1.Seq = 1
	late := grant(2, "k", "b/1", 2, 9*s, 3*s) // a delayed acquire that landed after its caller gave up
	rn := renew(3, "k", 2, 10*s, 3*s)
	rl := release(4, "k", 2, 11*s)
	h := &history.History{Audit: []history.Audit{g1, late, rn, rl}, Ops: []history.Op{
		{ID: 1, Kind: history.Acquire, Key: "k", Owner: "a/1", Token: 1, Call: s, Return: s, Outcome: history.OK, DBNow: g1.DBNow, Deadline: g1.Deadline},
		{ID: 2, Kind: history.Acquire, Key: "k", Owner: "b/1", Call: 5 * s, Return: 6 * s, Outcome: history.Indeterminate},
		{ID: 3, Kind: history.Acquire, Key: "k", Owner: "c/1", Call: 5 * s, Return: 6 * s, Outcome: history.Indeterminate},
		{ID: 4, Kind: history.Renew, Key: "k", Owner: "b/1", Token: 2, Call: 10 * s, Return: 10 * s, Outcome: history.OK, DBNow: rn.DBNow, Deadline: rn.Deadline},
		{ID: 5, Kind: history.Release, Key: "k", Owner: "b/1", Token: 2, Call: 11 * s, Return: 11 * s, Outcome: history.OK},
	}}
	require.Zero(t, history.LinkAudit(h, time.Millisecond))
	require.Equal(t, int64(1), h.Ops[0].Audit)
	require.Equal(t, int64(2), h.Ops[1].Audit, "the late grant is b's lost acquire")
	require.Zero(t, h.Ops[2].Audit, "c's lost acquire was never applied")
	require.Equal(t, int64(3), h.Ops[3].Audit)
	require.Equal(t, int64(4), h.Ops[4].Audit)
	ops := history.LinOperations(h, true)
	require.Len(t, ops, 4, "c's acquire is dropped")
	r := &history.Report{}
	history.CheckLin(h, r, true, 10*time.Second)
	require.Equal(t, "Ok", r.Lin, r.First())
}
