package history

import (
	"fmt"
	"math"
	"sort"
	"strings"
	"time"
)

// Checker names, as they appear in violations and figure lines.
const (
	CToken      = "C-TOKEN"
	CDBOverlap  = "C-DBOVERLAP"
	CGuard      = "C-GUARD"
	CFence      = "C-FENCE"
	CLostUpdate = "C-LOSTUPDATE"
	CLive       = "C-LIVE"
	CLin        = "C-LIN"
)

// Violation is one broken invariant.
type Violation struct {
	Checker string `json:"checker"`
	Key     string `json:"key,omitempty"`
	At      int64  `json:"at"`
	Msg     string `json:"msg"`
}

func (v Violation) String() string {
	return fmt.Sprintf("%s key=%q at=%v: %s", v.Checker, v.Key, time.Duration(v.At), v.Msg)
}

// Report is the result of the checkers over one history.
type Report struct {
	Violations []Violation `json:"violations"`

	// Documented cases, counted apart and not anomalies: a paused holder
	// acting after its guard ended (assumption A3 in the README), a guard
	// overlapping the next holder after an operator forced its lease to
	// expire (it must end at its next renewal), and overlaps after a
	// database clock step beyond the margin (assumption A2).
	PausedOverlaps int `json:"paused_overlaps"`
	ForcedOverlaps int `json:"forced_overlaps"`
	ClockOverlaps  int `json:"clock_overlaps"`

	// Fenced accesses: writes whose token was below the highest the
	// resource had seen (attempted = rejected + applied; applied must be
	// 0), and writes of paused holders.
	StaleAttempted  int `json:"stale_attempted"`
	StaleRejected   int `json:"stale_rejected"`
	StaleApplied    int `json:"stale_applied"`
	ZombieWrites    int `json:"zombie_writes"`
	ZombieRejected  int `json:"zombie_rejected"`
	AcceptedWrites  int `json:"accepted_writes"`
	LiveObligations int `json:"live_obligations"`

	// Lin is porcupine's verdict ("Ok", "Illegal", "Unknown"; "" when not
	// run) and LinTime how long it took.
	Lin     string        `json:"lin"`
	LinTime time.Duration `json:"lin_time"`
	LinOps  int           `json:"lin_ops"`
}

// Anomalies counts the violations (the documented cases are not anomalies).
func (r *Report) Anomalies() int { return len(r.Violations) }

// Count returns the violations of one checker.
func (r *Report) Count(checker string) int {
	n := 0
	for _, v := range r.Violations {
		if v.Checker == checker {
			n++
		}
	}
	return n
}

// First describes the first violation, or "" if there is none.
func (r *Report) First() string {
	if len(r.Violations) == 0 {
		return ""
	}
	return r.Violations[0].String()
}

// Checkers lists the checkers that fired, in order, without repeats.
func (r *Report) Checkers() string {
	var out []string
	seen := map[string]bool{}
	for _, v := range r.Violations {
		if !seen[v.Checker] {
			seen[v.Checker] = true
			out = append(out, v.Checker)
		}
	}
	return strings.Join(out, ",")
}

func (r *Report) add(checker, key string, at int64, format string, args ...any) {
	r.Violations = append(r.Violations, Violation{Checker: checker, Key: key, At: at, Msg: fmt.Sprintf(format, args...)})
}

// Check runs every checker except C-LIN (see [CheckLin]) over h.
func Check(h *History) *Report {
	r := &Report{}
	CheckToken(h, r)
	CheckDBOverlap(h, r)
	CheckGuard(h, r)
	CheckFence(h, r)
	CheckLostUpdate(h, r)
	CheckPermits(h, r)
	if !h.Params.NoLiveness {
		CheckLive(h, r)
	}
	return r
}

// auditByKey returns the audit records per key in application order.
func auditByKey(h *History) map[string][]Audit {
	m := map[string][]Audit{}
	as := append([]Audit(nil), h.Audit...)
	sort.SliceStable(as, func(i, j int) bool { return as[i].Seq < as[j].Seq })
	for _, a := range as {
		m[a.Key] = append(m[a.Key], a)
	}
	return m
}

func sortedKeys[V any](m map[string]V) []string {
	ks := make([]string, 0, len(m))
	for k := range m {
		ks = append(ks, k)
	}
	sort.Strings(ks)
	return ks
}

// CheckToken (C-TOKEN, G2): per key, the tokens of new grants strictly
// increase in application order (exactly +1 with Params.TokenStep1); a
// re-grant to the same owner keeps its token; no token is handed to two
// owners; every granted token a client saw is the one the backend applied.
func CheckToken(h *History, r *Report) {
	byKey := auditByKey(h)
	for _, key := range sortedKeys(byKey) {
		var cur int64
		var owner string
		for _, a := range byKey[key] {
			if a.Kind != Acquire || a.Outcome != OK {
				continue
			}
			switch {
			case a.Token == cur && a.Owner == owner:
				// a retry of the same acquire: same grant
			case a.Token <= cur:
				r.add(CToken, key, a.At, "grant of token %d to %q after token %d (audit seq %d): tokens must strictly increase", a.Token, a.Owner, cur, a.Seq)
			case h.Params.TokenStep1 && a.Token != cur+1:
				r.add(CToken, key, a.At, "grant of token %d after %d skips tokens (audit seq %d)", a.Token, cur, a.Seq)
			}
			if a.Token > cur || a.Owner != owner {
				cur, owner = max(cur, a.Token), a.Owner
			}
		}
	}
	type kt struct {
		key   string
		token int64
	}
	owners := map[kt]string{}
	audit := map[int64]Audit{}
	for _, a := range h.Audit {
		audit[a.Seq] = a
	}
	for _, op := range h.Ops {
		if op.Kind != Acquire || op.Outcome != OK {
			continue
		}
		k := kt{op.Key, op.Token}
		if o, ok := owners[k]; ok && o != op.Owner {
			r.add(CToken, op.Key, op.Return, "token %d handed to two owners: %q and %q", op.Token, o, op.Owner)
		}
		owners[k] = op.Owner
		if a, ok := audit[op.Audit]; ok && op.Audit != 0 && a.Token != op.Token {
			r.add(CToken, op.Key, op.Return, "client saw token %d, backend granted %d (op %d)", op.Token, a.Token, op.ID)
		}
	}
}

// CheckDBOverlap (C-DBOVERLAP, G1): per key, in application order, a new
// grant happens only when the previous tenure was released or its last
// applied deadline has passed by the grant's own database time; a renew
// succeeds only for the current, unexpired tenure. Exact in database time,
// also across database clock steps.
func CheckDBOverlap(h *History, r *Report) {
	byKey := auditByKey(h)
	for _, key := range sortedKeys(byKey) {
		var cur, deadline int64
		var owner string
		held := false
		for _, a := range byKey[key] {
			switch a.Kind {
			case Acquire:
				if a.Outcome != OK {
					continue
				}
				if a.Token == cur && a.Owner == owner && held {
					if a.DBNow >= deadline {
						r.add(CDBOverlap, key, a.At, "re-grant of expired token %d at db %v after its deadline %v", a.Token, dbt(a.DBNow), dbt(deadline))
					}
					deadline = max(deadline, a.Deadline)
					continue
				}
				if held && a.DBNow < deadline {
					r.add(CDBOverlap, key, a.At, "token %d granted to %q at db %v while token %d (%q) is held until %v (audit seq %d)",
						a.Token, a.Owner, dbt(a.DBNow), cur, owner, dbt(deadline), a.Seq)
				}
				cur, owner, held, deadline = a.Token, a.Owner, true, a.Deadline
			case Renew:
				if a.Outcome != OK {
					continue
				}
				switch {
				case a.Token != cur:
					r.add(CDBOverlap, key, a.At, "renew of token %d succeeded while token %d is current (audit seq %d)", a.Token, cur, a.Seq)
				case !held || a.DBNow >= deadline:
					r.add(CDBOverlap, key, a.At, "renew of token %d revived a released or expired lease at db %v (deadline %v)", a.Token, dbt(a.DBNow), dbt(deadline))
				default:
					deadline = max(deadline, a.Deadline)
				}
			case Release:
				if a.Token == cur {
					held = false
				}
			case Expire:
				deadline = a.Deadline
			}
		}
	}
}

func dbt(ns int64) string { return time.Unix(0, ns).UTC().Format("15:04:05.000000") }

// CheckGuard (C-GUARD, G3): every guard is cancelled no later than the send
// time of its last successful acquire or renew + TTL - margin, and at once
// when a renewal reports the lease lost; per key, guard lifetimes are
// disjoint in local time, except the documented cases counted apart.
func CheckGuard(h *History, r *Report) {
	type lease struct {
		key   string
		token int64
	}
	oks := map[lease][]Op{}
	losts := map[lease][]Op{}
	releases := map[lease]int64{}
	for _, op := range h.Ops {
		l := lease{op.Key, op.Token}
		switch {
		case (op.Kind == Acquire || op.Kind == Renew) && op.Outcome == OK:
			oks[l] = append(oks[l], op)
		case op.Kind == Renew && op.Outcome == Lost:
			losts[l] = append(losts[l], op)
		case op.Kind == Release:
			if c, ok := releases[l]; !ok || op.Call < c {
				releases[l] = op.Call
			}
		}
	}
	eps := int64(h.Params.Eps)
	byKey := map[string][]Guard{}
	for _, g := range h.Guards {
		byKey[g.Key] = append(byKey[g.Key], g)
		l := lease{g.Key, g.Token}
		if g.End == math.MaxInt64 {
			r.add(CGuard, g.Key, g.Start, "guard %d (token %d) never ended", g.ID, g.Token)
			continue
		}
		last := int64(math.MinInt64)
		for _, op := range oks[l] {
			if op.Owner == g.Owner && op.Return <= g.End && op.Call > last {
				last = op.Call
			}
		}
		if last == math.MinInt64 {
			r.add(CGuard, g.Key, g.Start, "guard %d (token %d) has no successful acquire in the history", g.ID, g.Token)
			continue
		}
		if bound := last + int64(g.TTL-g.Margin) + eps; g.End > bound {
			r.add(CGuard, g.Key, g.End, "guard %d (token %d) cancelled at %v, after send time of its last success %v + TTL %v - margin %v = %v",
				g.ID, g.Token, time.Duration(g.End), time.Duration(last), g.TTL, g.Margin, time.Duration(bound))
		} else if g.LocalDeadline > bound {
			// However the guard ended, the deadline it believed in
			// must not have been later either: a guard released before
			// its deadline still acted on that belief.
			r.add(CGuard, g.Key, g.End, "guard %d (token %d) reported local deadline %v, after send time of its last success %v + TTL %v - margin %v = %v",
				g.ID, g.Token, time.Duration(g.LocalDeadline), time.Duration(last), g.TTL, g.Margin, time.Duration(bound))
		}
		rel, released := releases[l]
		for _, op := range losts[l] {
			if released && op.Return >= rel {
				continue // the release owns the end
			}
			if op.Return < g.End-eps {
				r.add(CGuard, g.Key, op.Return, "renew of token %d reported the lease lost at %v but guard %d stayed valid until %v",
					g.Token, time.Duration(op.Return), g.ID, time.Duration(g.End))
				break
			}
		}
	}
	// grantAt is when the backend applied a tenure's grant (for the
	// documented cases, which start there); the guard's start otherwise.
	grantAt := map[lease]int64{}
	for _, a := range h.Audit {
		l := lease{a.Key, a.Token}
		if _, ok := grantAt[l]; !ok && a.Kind == Acquire && a.Outcome == OK {
			grantAt[l] = a.At
		}
	}
	for _, key := range sortedKeys(byKey) {
		gs := byKey[key]
		sort.SliceStable(gs, func(i, j int) bool { return gs[i].Token < gs[j].Token })
		for i := range gs {
			for j := i + 1; j < len(gs); j++ {
				a, b := gs[i], gs[j] // a's token is older
				if a.Token == b.Token {
					// One tenure, one guard: two guards of one token
					// alive at once mean two holders were handed the
					// same grant (an owner name shared by two clients).
					if b.Start < a.End && a.Start < b.End {
						r.add(CGuard, key, max(a.Start, b.Start), "guards %d (%q) and %d (%q) share token %d and overlap in local time",
							a.ID, a.Owner, b.ID, b.Owner, a.Token)
					}
					continue
				}
				end := a.End
				if a.Zombie && a.BeliefEnd > end {
					end = a.BeliefEnd
				}
				if b.Start >= end || a.Start >= b.End {
					continue
				}
				la := lease{a.Key, a.Token}
				from, ok := grantAt[la]
				if !ok {
					from = a.Start
				}
				switch {
				case b.Start >= a.End:
					r.PausedOverlaps++
				case hasEvent(h, EvExpire, key, from, max(a.Start, b.Start), false):
					r.ForcedOverlaps++
				case h.Params.ClockStepsBeyondMargin && hasEvent(h, EvClockJump, "", from, max(a.Start, b.Start), true):
					r.ClockOverlaps++
				default:
					r.add(CGuard, key, max(a.Start, b.Start), "guards overlap in local time: guard %d (token %d, %q) [%v, %v] and guard %d (token %d, %q) [%v, %v]",
						a.ID, a.Token, a.Owner, time.Duration(a.Start), time.Duration(a.End), b.ID, b.Token, b.Owner, time.Duration(b.Start), time.Duration(b.End))
				}
			}
		}
	}
}

// hasEvent reports an event of kind (on key, unless key is "") in [from, to];
// forward selects clock jumps with D > 0.
func hasEvent(h *History, kind, key string, from, to int64, forward bool) bool {
	for _, e := range h.Events {
		if e.Kind == kind && (key == "" || e.Key == key) && e.At >= from && e.At <= to && (!forward || e.D > 0) {
			return true
		}
	}
	return false
}

// CheckFence (C-FENCE, G4): replays the accesses to the protected resource:
// no access with a token below the highest seen may be applied, and no
// current access may be refused. A refused access by a holder whose guard
// was valid means two holders overlapped (unless a documented case
// explains it).
func CheckFence(h *History, r *Report) {
	guards := map[int]Guard{}
	for _, g := range h.Guards {
		guards[g.ID] = g
	}
	grantAt := map[string]int64{}
	for _, a := range h.Audit {
		k := a.Key + "\x00" + fmt.Sprint(a.Token)
		if _, ok := grantAt[k]; !ok && a.Kind == Acquire && a.Outcome == OK {
			grantAt[k] = a.At
		}
	}
	highest := map[string]int64{}
	for _, a := range h.Accesses {
		stale := a.Token < highest[a.Key]
		if a.Write {
			if a.Zombie {
				r.ZombieWrites++
				if !a.Accepted {
					r.ZombieRejected++
				}
			}
			if a.Accepted {
				r.AcceptedWrites++
			}
			if stale {
				r.StaleAttempted++
				if a.Accepted {
					r.StaleApplied++
				} else {
					r.StaleRejected++
				}
			}
		}
		switch {
		case stale && a.Accepted:
			r.add(CFence, a.Key, a.At, "stale access applied: token %d below highest %d (client %d)", a.Token, highest[a.Key], a.Client)
		case !stale && !a.Accepted:
			r.add(CFence, a.Key, a.At, "current access refused: token %d, highest %d (client %d)", a.Token, highest[a.Key], a.Client)
		case stale && a.GuardValid && !a.Zombie:
			from := guards[a.Guard].Start
			if at, ok := grantAt[a.Key+"\x00"+fmt.Sprint(a.Token)]; ok {
				from = at
			}
			if hasEvent(h, EvExpire, a.Key, from, a.At, false) ||
				(h.Params.ClockStepsBeyondMargin && hasEvent(h, EvClockJump, "", from, a.At, true)) {
				break
			}
			r.add(CFence, a.Key, a.At, "holder with a valid guard (token %d, client %d) was fenced out by token %d: two holders at once", a.Token, a.Client, highest[a.Key])
		}
		if a.Accepted {
			highest[a.Key] = max(highest[a.Key], a.Token)
		}
	}
}

// CheckLostUpdate (C-LOSTUPDATE): every holder increments the counter by a
// fenced read-modify-write, so each key's final value equals its number of
// accepted writes.
func CheckLostUpdate(h *History, r *Report) {
	writes := map[string]int64{}
	for _, a := range h.Accesses {
		if a.Write && a.Accepted {
			writes[a.Key]++
		}
	}
	for _, key := range sortedKeys(writes) {
		if got := h.Final[key]; got != writes[key] {
			r.add(CLostUpdate, key, 0, "counter is %d after %d accepted increments: %d updates lost", got, writes[key], writes[key]-got)
		}
	}
}

// CheckLive (C-LIVE, G5): after a holder released (the release returned ok)
// or crashed while its lease was current, some contender acquires the key
// within (TTL, for a crash) + Params.Poll + Params.Eps — if a contender was
// waiting through that window without faults of its own and the database
// clock did not step.
func CheckLive(h *History, r *Report) {
	type stop struct {
		client    int
		key       string
		token     int64
		at, bound int64
		ttl       time.Duration
		kind      string
	}
	var stops []stop
	poll := int64(h.Params.Poll + h.Params.Eps)
	for _, op := range h.Ops {
		if op.Kind == Release && op.Outcome == OK && op.Audit != 0 {
			stops = append(stops, stop{op.Client, op.Key, op.Token, op.Return, op.Return + poll, op.TTL, "release"})
		}
	}
	for _, e := range h.Events {
		if e.Kind == EvCrash && e.Token > 0 {
			stops = append(stops, stop{e.Client, e.Key, e.Token, e.At, e.At + int64(e.TTL) + poll, e.TTL, "crash"})
		}
	}
	byKey := auditByKey(h)
	for _, s := range stops {
		// The stopped lease must be current at the stop.
		current, granted := true, false
		for _, a := range byKey[s.key] {
			if a.Kind != Acquire || a.Outcome != OK || a.Token <= s.token {
				continue
			}
			if a.At <= s.at {
				current = false
			} else if a.At <= s.bound {
				granted = true
			}
		}
		if !current {
			continue
		}
		if hasEvent(h, EvClockJump, "", s.at-2*int64(s.ttl), s.bound, false) || hasEvent(h, EvExpire, s.key, s.at-2*int64(s.ttl), s.bound, false) {
			continue
		}
		waiter := -1
		for _, w := range h.Waits {
			if w.Key != s.key || w.Client == s.client || w.Start > s.at || w.End < s.bound {
				continue
			}
			if faulted(h, w.Client, w.Start, s.at, s.bound) {
				continue
			}
			waiter = w.Client
			break
		}
		if waiter < 0 {
			continue
		}
		r.LiveObligations++
		if !granted {
			r.add(CLive, s.key, s.bound, "after the %s of token %d by client %d at %v, client %d waited without faults but nobody acquired by %v",
				s.kind, s.token, s.client, time.Duration(s.at), waiter, time.Duration(s.bound))
		}
	}
}

// faulted reports whether client had a fault injected in [start, to]
// (a fault before from may still hold its call, e.g. a hang), or
// crashed or paused since start.
func faulted(h *History, client int, start, from, to int64) bool {
	for _, f := range h.Faults {
		if f.Client == client && f.At >= start && f.At <= to {
			return true
		}
	}
	for _, e := range h.Events {
		if e.Client == client && (e.Kind == EvCrash || e.Kind == EvPause) && e.At >= start && e.At <= to {
			return true
		}
	}
	return false
}
