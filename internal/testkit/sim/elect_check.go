package sim

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"math"
	"sort"
	"time"

	"github.com/ashlock/ashlock/internal/testkit/history"
)

// The election checkers, as they appear in violations and figure lines.
const (
	// EOneLeader: at the start and at the end of every term (as its
	// function saw them), the term's lease is the database's live lease
	// at that instant: its newest grant, not released, and the database
	// clock before its deadline. With C-DBOVERLAP (the database never has
	// two live leases) this is "at most one leader whose leadership is
	// live at any database instant".
	EOneLeader = "E-ONELEADER"
	// ETerm: terms strictly increase in the order they started, and each
	// is a grant the database made to that leader.
	ETerm = "E-TERM"
	// EDeadline: every leader's function sees its context end no later
	// than its guard's local deadline (G3), recomputed from the recorded
	// calls: the send time of the last acquire or renewal that succeeded
	// before it (and before the deadline then in force) + TTL - margin.
	EDeadline = "E-DEADLINE"
	// ERelease: a term's lease is released only after its function
	// returned.
	ERelease = "E-RELEASE"
	// ECampaign: Run returns only when its context ended or its function
	// returned of its own accord; Campaign only with a leadership or when
	// its context ended; after every lost term the process campaigns
	// again (an acquire call) within ReleaseTimeout + ElectBackoffMax,
	// unless its context ends first; and no acquire attempt stays out
	// longer than the TTL while the process's context is live.
	ECampaign = "E-CAMPAIGN"
	// EObserve: an observer never receives a term lower than one it
	// received, nor a term as led again after it received that term's
	// end, and every leader it reports is a grant the database made.
	EObserve = "E-OBSERVE"
)

// ElectCheckers lists the election checkers in report order.
var ElectCheckers = []string{EOneLeader, ETerm, EDeadline, ERelease, ECampaign, EObserve}

// ElectReport is what the checkers found in one election history.
type ElectReport struct {
	// Lock is the lock checkers' report over the lock history (C-TOKEN,
	// C-DBOVERLAP, C-GUARD with each term as a guard, C-FENCE,
	// C-LOSTUPDATE).
	Lock       *history.Report     `json:"lock"`
	Violations []history.Violation `json:"violations"`

	Terms, Lost, Voluntary, Stopped int // terms, by how they ended
	Writes                          int // the leaders' fenced writes
	Obligations                     int // lost terms after which a campaign was due
	RunReturns, CampaignReturns     int
	Observations                    int
	// Observed counts the terms some observer reported as leading.
	Observed int
}

// Anomalies counts every violation, the lock checkers' included.
func (r *ElectReport) Anomalies() int { return len(r.Violations) + r.Lock.Anomalies() }

// Count returns the violations of one checker (election or lock).
func (r *ElectReport) Count(checker string) int {
	n := r.Lock.Count(checker)
	for _, v := range r.Violations {
		if v.Checker == checker {
			n++
		}
	}
	return n
}

// all is every violation, the election's first.
func (r *ElectReport) all() []history.Violation {
	return append(append([]history.Violation(nil), r.Violations...), r.Lock.Violations...)
}

// First describes the first violation, or "".
func (r *ElectReport) First() string {
	if v := r.all(); len(v) > 0 {
		return v[0].String()
	}
	return ""
}

// Checkers lists the checkers that fired, in order, without repeats.
func (r *ElectReport) Checkers() string {
	rep := history.Report{Violations: r.all()}
	return rep.Checkers()
}

func (r *ElectReport) add(checker string, at int64, format string, args ...any) {
	r.Violations = append(r.Violations, history.Violation{Checker: checker, At: at, Msg: fmt.Sprintf(format, args...)})
}

// ElectCheck runs the lock checkers and the election checkers over h.
func ElectCheck(h *ElectHistory) *ElectReport {
	r := &ElectReport{Lock: history.Check(h.Lock)}
	incs := map[int]Incarnation{}
	for _, in := range h.Incarnations {
		incs[in.Client] = in
	}
	checkOneLeader(h, r)
	checkTerms(h, r)
	checkDeadline(h, incs, r)
	checkRelease(h, r)
	checkCampaign(h, incs, r)
	checkObserve(h, r)
	for _, t := range h.Terms {
		r.Terms++
		r.Writes += t.Writes
		switch {
		case t.Voluntary:
			r.Voluntary++
		case t.Lost:
			r.Lost++
		default:
			r.Stopped++
		}
	}
	return r
}

// leaseState is the database's view of the key at one local instant.
type leaseState struct {
	token    int64
	owner    string
	held     bool
	deadline int64
}

// stateAt replays the audit log up to local instant x: every application
// before x, and the grant and renewals of token applied at x itself (a
// term starts at the instant of its grant).
func stateAt(audit []history.Audit, x int64, token int64) leaseState {
	var s leaseState
	for _, a := range audit {
		if a.At > x || (a.At == x && !(a.Token == token && (a.Kind == history.Acquire || a.Kind == history.Renew))) {
			continue
		}
		switch a.Kind {
		case history.Acquire:
			if a.Outcome != history.OK {
				continue
			}
			if a.Token == s.token && a.Owner == s.owner && s.held {
				s.deadline = max(s.deadline, a.Deadline)
				continue
			}
			s = leaseState{token: a.Token, owner: a.Owner, held: true, deadline: a.Deadline}
		case history.Renew:
			if a.Outcome == history.OK && a.Token == s.token {
				s.deadline = max(s.deadline, a.Deadline)
			}
		case history.Release:
			if a.Token == s.token {
				s.held = false
			}
		case history.Expire:
			s.deadline = a.Deadline
		}
	}
	return s
}

func keyAudit(h *ElectHistory) []history.Audit {
	var as []history.Audit
	for _, a := range h.Lock.Audit {
		if a.Key == h.Key {
			as = append(as, a)
		}
	}
	sort.SliceStable(as, func(i, j int) bool { return as[i].Seq < as[j].Seq })
	return as
}

func checkOneLeader(h *ElectHistory, r *ElectReport) {
	audit := keyAudit(h)
	for _, t := range h.Terms {
		for _, p := range []struct {
			what   string
			at, db int64
		}{{"start", t.Start, t.DBStart}, {"end", t.End, t.DBEnd}} {
			s := stateAt(audit, p.at, t.Token)
			switch {
			case s.token != t.Token:
				r.add(EOneLeader, p.at, "term %d of %q at its %s: the database's newest grant is token %d (%q)", t.Token, t.Leader, p.what, s.token, s.owner)
			case !s.held:
				r.add(EOneLeader, p.at, "term %d of %q at its %s: its lease was already released", t.Token, t.Leader, p.what)
			case p.db >= s.deadline:
				r.add(EOneLeader, p.at, "term %d of %q at its %s: database clock %v is not before the lease's deadline %v",
					t.Token, t.Leader, p.what, dbTime(p.db), dbTime(s.deadline))
			}
		}
	}
}

func dbTime(ns int64) string { return time.Unix(0, ns).UTC().Format("15:04:05.000000") }

// grant is a lease the database granted: its token and owner.
type grant struct {
	token int64
	owner string
}

// grants are the leases of the election's key that the database granted
// (its audit log).
func grants(h *ElectHistory) map[grant]bool {
	granted := map[grant]bool{}
	for _, a := range h.Lock.Audit {
		if a.Key == h.Key && a.Kind == history.Acquire && a.Outcome == history.OK {
			granted[grant{a.Token, a.Owner}] = true
		}
	}
	return granted
}

func checkTerms(h *ElectHistory, r *ElectReport) {
	granted := grants(h)
	ts := append([]TermRecord(nil), h.Terms...)
	sort.SliceStable(ts, func(i, j int) bool {
		if ts[i].Start != ts[j].Start {
			return ts[i].Start < ts[j].Start
		}
		return ts[i].Token < ts[j].Token
	})
	for i, t := range ts {
		if !granted[grant{t.Token, t.Leader}] {
			r.add(ETerm, t.Start, "term %d of %q was never granted to it by the database", t.Token, t.Leader)
		}
		if i > 0 && t.Token <= ts[i-1].Token {
			r.add(ETerm, t.Start, "term %d (%q) started after term %d (%q): terms must strictly increase", t.Token, t.Leader, ts[i-1].Token, ts[i-1].Leader)
		}
	}
}

func checkDeadline(h *ElectHistory, incs map[int]Incarnation, r *ElectReport) {
	type lease struct {
		token int64
		owner string
	}
	oks := map[lease][]history.Op{}
	for _, op := range h.Lock.Ops {
		if op.Key == h.Key && (op.Kind == history.Acquire || op.Kind == history.Renew) && op.Outcome == history.OK {
			l := lease{op.Token, op.Owner}
			oks[l] = append(oks[l], op)
		}
	}
	for _, t := range h.Terms {
		in := incs[t.Client]
		ops := oks[lease{t.Token, t.Leader}]
		sort.SliceStable(ops, func(i, j int) bool { return ops[i].Return < ops[j].Return })
		local := int64(math.MinInt64)
		for _, op := range ops {
			if op.Return > t.End {
				break
			}
			nl := op.Call + int64(in.TTL-in.Margin)
			switch {
			case op.Kind == history.Acquire:
				local = max(local, nl)
			case op.Return <= local:
				local = max(local, nl) // a renewal that came back too late extends nothing
			}
		}
		if local == math.MinInt64 {
			r.add(EDeadline, t.Start, "term %d of %q led without a successful acquire in the history", t.Token, t.Leader)
			continue
		}
		if t.End > local {
			r.add(EDeadline, t.End, "the function of term %d (%q) saw its context end at %v, %v after the guard's local deadline %v",
				t.Token, t.Leader, time.Duration(t.End), time.Duration(t.End-local), time.Duration(local))
		}
	}
}

func checkRelease(h *ElectHistory, r *ElectReport) {
	type lease struct {
		token int64
		owner string
	}
	ret := map[lease]int64{}
	for _, t := range h.Terms {
		ret[lease{t.Token, t.Leader}] = t.Return
	}
	for _, op := range h.Lock.Ops {
		if op.Key != h.Key || op.Kind != history.Release {
			continue
		}
		if at, ok := ret[lease{op.Token, op.Owner}]; ok && op.Call < at {
			r.add(ERelease, op.Call, "term %d of %q released at %v, before its function returned at %v", op.Token, op.Owner, time.Duration(op.Call), time.Duration(at))
		}
	}
}

func checkCampaign(h *ElectHistory, incs map[int]Incarnation, r *ElectReport) {
	for _, rt := range h.Returns {
		if rt.API == "run" {
			r.RunReturns++
		} else {
			r.CampaignReturns++
		}
		switch {
		case rt.CtxDone:
		case rt.API == "run" && rt.AfterVoluntary:
		case rt.API == "run":
			r.add(ECampaign, rt.At, "Run of client %d returned while its context was live and its function had not returned of its own accord: %s", rt.Client, rt.Err)
		case rt.Err != "":
			r.add(ECampaign, rt.At, "Campaign of client %d gave up while its context was live: %s", rt.Client, rt.Err)
		}
	}
	acquires := map[int][]int64{}
	for _, op := range h.Lock.Ops {
		if op.Key != h.Key || op.Kind != history.Acquire {
			continue
		}
		acquires[op.Client] = append(acquires[op.Client], op.Call)
		// A campaign whose attempt never comes back is not campaigning:
		// an attempt must end within the TTL (its grant could not be
		// used later anyway), unless the process's context ended first.
		in, ok := incs[op.Client]
		if ok && op.Return-op.Call > int64(in.TTL) && in.CtxEnd > op.Call+int64(in.TTL) {
			r.add(ECampaign, op.Call+int64(in.TTL), "an acquire attempt of client %d sent at %v was still out after the TTL %v (returned at %v), its context live: the process stopped campaigning",
				op.Client, time.Duration(op.Call), in.TTL, returned(op.Return))
		}
	}
	for _, t := range h.Terms {
		if !t.Lost {
			continue
		}
		bound := t.Return + int64(ElectReleaseTimeout+ElectBackoffMax+time.Millisecond)
		if incs[t.Client].CtxEnd <= bound {
			continue
		}
		r.Obligations++
		again := false
		for _, c := range acquires[t.Client] {
			if c >= t.Return && c <= bound {
				again = true
				break
			}
		}
		if !again {
			r.add(ECampaign, bound, "client %d lost term %d at %v and did not campaign again by %v", t.Client, t.Token, time.Duration(t.End), time.Duration(bound))
		}
	}
}

func returned(at int64) string {
	if at == math.MaxInt64 {
		return "never"
	}
	return time.Duration(at).String()
}

func checkObserve(h *ElectHistory, r *ElectReport) {
	granted := grants(h)
	last := map[int]int64{} // per observer: the highest term it reported
	type term struct {
		observer int
		token    int64
	}
	ended := map[term]bool{} // terms an observer reported ended
	seen := map[int64]bool{}
	// Each observer's records are in the order it received them.
	for _, o := range h.Observations {
		r.Observations++
		if !o.Leading && o.Token > 0 {
			ended[term{o.Observer, o.Token}] = true
		}
		if o.Leading && ended[term{o.Observer, o.Token}] {
			r.add(EObserve, o.At, "observer %d reported term %d led again after it had reported it ended", o.Observer, o.Token)
		}
		if o.Token < last[o.Observer] {
			r.add(EObserve, o.At, "observer %d reported term %d after term %d", o.Observer, o.Token, last[o.Observer])
		}
		last[o.Observer] = max(last[o.Observer], o.Token)
		if o.Leading {
			if !granted[grant{o.Token, o.Leader}] {
				r.add(EObserve, o.At, "observer %d reported term %d led by %q, which the database never granted", o.Observer, o.Token, o.Leader)
			}
			seen[o.Token] = true
		}
	}
	r.Observed = len(seen)
}

// Hash is a SHA-256 of the history's content in a canonical order, owners
// normalized (see history.History.Hash): two runs of one seed hash alike.
func (h *ElectHistory) Hash() string {
	parts := []any{h.Lock.Hash()}
	terms := append([]TermRecord(nil), h.Terms...)
	for i := range terms {
		terms[i].Guard = 0 // an ID: the order two goroutines recorded in
	}
	for _, s := range []any{h.Incarnations, terms, h.Returns, h.Observations} {
		b, err := json.Marshal(s)
		if err != nil {
			panic(err)
		}
		var elems []json.RawMessage
		if err := json.Unmarshal(b, &elems); err != nil {
			panic(err)
		}
		keys := make([]string, len(elems))
		for i, e := range elems {
			keys[i] = history.NormalizeOwner(string(e))
		}
		sort.Strings(keys)
		parts = append(parts, keys)
	}
	b, err := json.Marshal(parts)
	if err != nil {
		panic(err)
	}
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}
