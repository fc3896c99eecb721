package history

import (
	"sort"

	"github.com/ashlock/ashlock/sqllock"
)

// CPermits names the semaphore checker.
const CPermits = "C-PERMITS"

// CheckPermits (C-PERMITS): per semaphore of Params.Permits, at no instant
// of the database clock are more of its permits held than its limit. A
// permit's tenure runs, in database time, from its grant to the earlier of
// its release and its last applied deadline (renewals move it, expiries
// cut it); the tenures of all the semaphore's permits are swept in time
// order. A grant of a permit above the limit counts as held all the same:
// the limit is what the checker was told, not what the backend did.
func CheckPermits(h *History, r *Report) {
	if len(h.Params.Permits) == 0 {
		return
	}
	type tenure struct {
		start, end int64
		at         int64 // recorder time of the grant, for the report
	}
	bySem := map[string][]tenure{}
	byKey := auditByKey(h)
	for _, key := range sortedKeys(byKey) {
		sem, _, ok := sqllock.ParsePermitKey(key)
		if _, limited := h.Params.Permits[sem]; !ok || !limited {
			continue
		}
		var cur tenure
		var token int64
		var owner string
		held := false
		closeTenure := func(end int64) {
			if held {
				cur.end = min(cur.end, end)
				bySem[sem] = append(bySem[sem], cur)
				held = false
			}
		}
		for _, a := range byKey[key] {
			switch {
			case a.Kind == Acquire && a.Outcome == OK:
				if held && a.Token == token && a.Owner == owner {
					cur.end = max(cur.end, a.Deadline) // a retry's re-grant
					continue
				}
				closeTenure(a.DBNow)
				cur, token, owner, held = tenure{start: a.DBNow, end: a.Deadline, at: a.At}, a.Token, a.Owner, true
			case a.Kind == Renew && a.Outcome == OK && held && a.Token == token:
				cur.end = max(cur.end, a.Deadline)
			case a.Kind == Release && held && a.Token == token:
				closeTenure(a.DBNow)
			case a.Kind == Expire && held:
				cur.end = min(cur.end, a.Deadline)
			}
		}
		closeTenure(cur.end)
	}
	for _, sem := range sortedKeys(bySem) {
		ts := bySem[sem]
		limit := h.Params.Permits[sem]
		type edge struct {
			t     int64
			delta int
			at    int64
		}
		var es []edge
		for _, t := range ts {
			if t.end > t.start {
				es = append(es, edge{t.start, 1, t.at}, edge{t.end, -1, t.at})
			}
		}
		// Ends before starts at one instant: a deadline at t frees the
		// permit for a grant at t.
		sort.Slice(es, func(i, j int) bool {
			if es[i].t != es[j].t {
				return es[i].t < es[j].t
			}
			return es[i].delta < es[j].delta
		})
		n := 0
		for _, e := range es {
			n += e.delta
			if e.delta > 0 && n > limit {
				r.add(CPermits, sem, e.at, "%d permits of %q held at db %v, limit %d", n, sem, dbt(e.t), limit)
			}
		}
	}
}
