package history

import (
	"sort"
	"time"
)

// WallBase is the recorder's base on the wall clock, in Unix ns: a
// database on the same host reports times on that clock, so a database
// time t is local time t - WallBase.
func (r *Recorder) WallBase() int64 { return r.base.UnixNano() }

// LinkAudit links the calls of h to audit records read from a database,
// which knows nothing of calls: a definite success claims the record with
// its exact result; a release claims the record made while it ran; every
// record left is given to the latest unknown call (lost reply, timeout) of
// the same acquire owner or lease that started before it, as the
// application of that call. Calls still unknown and unlinked were not
// applied. slack absorbs the difference between local and database time.
// It returns the number of records no call claimed (0 unless the history
// misses calls).
func LinkAudit(h *History, slack time.Duration) int {
	sl := int64(slack)
	claimed := map[int64]bool{}
	link := func(op *Op, a *Audit) {
		op.Audit, a.Op = a.Seq, op.ID
		claimed[a.Seq] = true
	}
	audit := make([]*Audit, len(h.Audit))
	for i := range h.Audit {
		audit[i] = &h.Audit[i]
	}
	sort.SliceStable(audit, func(i, j int) bool { return audit[i].Seq < audit[j].Seq })
	ops := make([]*Op, len(h.Ops))
	for i := range h.Ops {
		ops[i] = &h.Ops[i]
	}
	sort.SliceStable(ops, func(i, j int) bool { return ops[i].Call < ops[j].Call })

	// Definite successes of acquire and renew: exact results.
	for _, op := range ops {
		if op.Outcome != OK || (op.Kind != Acquire && op.Kind != Renew) {
			continue
		}
		for _, a := range audit {
			if !claimed[a.Seq] && a.Kind == op.Kind && a.Key == op.Key && a.Token == op.Token &&
				a.Deadline == op.Deadline && (op.Kind != Acquire || a.Owner == op.Owner) {
				link(op, a)
				break
			}
		}
	}
	// Definite releases (ok or lost) that ran while the record was made.
	for _, a := range audit {
		if claimed[a.Seq] || a.Kind != Release {
			continue
		}
		for _, op := range ops {
			if op.Kind == Release && !op.Outcome.Unknown() && op.Audit == 0 && op.Key == a.Key && op.Token == a.Token &&
				op.Call-sl <= a.At && a.At <= op.Return+sl {
				link(op, a)
				break
			}
		}
	}
	// The rest: applications of unknown calls.
	left := 0
	for _, a := range audit {
		if claimed[a.Seq] || a.Kind == Expire {
			continue
		}
		var best *Op
		for _, op := range ops {
			if op.Call-sl > a.At {
				break
			}
			if op.Audit != 0 || !op.Outcome.Unknown() || op.Kind != a.Kind || op.Key != a.Key {
				continue
			}
			if (a.Kind == Acquire && op.Owner == a.Owner) || (a.Kind != Acquire && op.Token == a.Token) {
				best = op
			}
		}
		if best == nil {
			left++
			continue
		}
		link(best, a)
	}
	return left
}
