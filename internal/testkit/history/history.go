// Package history records what lock clients saw and what the backend did,
// and checks the record: pure functions over a [History] (see check.go and
// lin.go). The fault-injecting backend (internal/faultbackend) and the
// simulation (internal/testkit/sim) fill it; the PostgreSQL robustness tests fill
// the same types from real clients and a database audit log.
//
// Times: Call, Return, At, Start and End are local monotonic nanoseconds
// since the recorder's base; DBNow and Deadline are the backend clock's
// Unix nanoseconds.
package history

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"math"
	"regexp"
	"sort"
	"sync"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// Outcome is how one backend call ended.
type Outcome string

// The outcomes. Indeterminate, Unavailable and Failed are unknown to the
// caller: the call may or may not have been applied.
const (
	OK            Outcome = "ok"
	Held          Outcome = "held"
	Lost          Outcome = "lost"
	Indeterminate Outcome = "indeterminate"
	Unavailable   Outcome = "unavailable"
	Invalid       Outcome = "invalid"
	Exhausted     Outcome = "exhausted"
	Failed        Outcome = "error"
)

// Unknown reports whether the caller cannot tell if the call was applied.
func (o Outcome) Unknown() bool { return o == Indeterminate || o == Unavailable || o == Failed }

// Classify maps a backend error to its outcome.
func Classify(err error) Outcome {
	switch {
	case err == nil:
		return OK
	case errors.Is(err, sqllock.ErrNotAcquired):
		return Held
	case errors.Is(err, sqllock.ErrLeaseLost):
		return Lost
	case errors.Is(err, sqllock.ErrIndeterminate):
		return Indeterminate
	case errors.Is(err, sqllock.ErrUnavailable):
		return Unavailable
	case errors.Is(err, sqllock.ErrInvalidKey), errors.Is(err, sqllock.ErrInvalidTTL),
		errors.Is(err, sqllock.ErrInvalidOwner), errors.Is(err, sqllock.ErrInvalidToken):
		return Invalid
	case errors.Is(err, sqllock.ErrTokenExhausted):
		return Exhausted
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return Indeterminate
	}
	return Failed
}

// OpKind names a backend call.
type OpKind string

// The backend calls that are recorded.
const (
	Acquire OpKind = "acquire"
	Renew   OpKind = "renew"
	Release OpKind = "release"
	Expire  OpKind = "expire" // audit only: an operator forced the lease to expire
)

// Op is one backend call as its caller saw it.
type Op struct {
	ID     int    `json:"id"`
	Client int    `json:"client"`
	Kind   OpKind `json:"kind"`
	Key    string `json:"key"`
	// Owner is the acquire request's owner, or the lease's owner.
	Owner string        `json:"owner"`
	TTL   time.Duration `json:"ttl"`
	// Token is the lease's token (renew, release) or the granted token
	// (acquire, when ok).
	Token   int64   `json:"token"`
	Call    int64   `json:"call"`
	Return  int64   `json:"return"`
	Outcome Outcome `json:"outcome"`
	Err     string  `json:"err,omitempty"`
	// DBNow and Deadline as the reply reported them (ok only).
	DBNow    int64 `json:"db_now,omitempty"`
	Deadline int64 `json:"deadline,omitempty"`
	// Fault is the fault injected into this call, if any.
	Fault string `json:"fault,omitempty"`
	// Audit is the Seq of the audit record of this call's application,
	// 0 when it was not applied or it is not known.
	Audit int64 `json:"audit,omitempty"`
}

// Audit is one operation the backend applied: the database's own record
// (etcd's "persisted requests"), in the order the backend applied them.
type Audit struct {
	Seq   int64  `json:"seq"`
	Kind  OpKind `json:"kind"`
	Key   string `json:"key"`
	Owner string `json:"owner,omitempty"`
	// Token of the lease the operation concerned (granted, renewed,
	// released).
	Token int64 `json:"token"`
	// Outcome is what the backend answered.
	Outcome  Outcome       `json:"outcome"`
	TTL      time.Duration `json:"ttl,omitempty"`
	DBNow    int64         `json:"db_now"`
	Deadline int64         `json:"deadline,omitempty"`
	At       int64         `json:"at"`
	Op       int           `json:"op,omitempty"`
}

// Guard is one guard's life in local time.
type Guard struct {
	ID       int           `json:"id"`
	Client   int           `json:"client"`
	Key      string        `json:"key"`
	Owner    string        `json:"owner"`
	Token    int64         `json:"token"`
	TTL      time.Duration `json:"ttl"`
	Margin   time.Duration `json:"margin"`
	Interval time.Duration `json:"interval"`
	Start    int64         `json:"start"`
	// End is when the guard's context was cancelled; math.MaxInt64 while
	// it has not been.
	End   int64  `json:"end"`
	Cause string `json:"cause,omitempty"`
	// LocalDeadline as the guard reported it at its end.
	LocalDeadline int64 `json:"local_deadline"`
	// Zombie marks a holder that was paused and kept acting past its
	// guard's end (the documented paused-holder case); BeliefEnd is its
	// last action.
	Zombie    bool  `json:"zombie,omitempty"`
	BeliefEnd int64 `json:"belief_end,omitempty"`
}

// Access is one fenced access to the protected resource.
type Access struct {
	Client   int    `json:"client"`
	Guard    int    `json:"guard"`
	Key      string `json:"key"`
	Token    int64  `json:"token"`
	Write    bool   `json:"write"`
	At       int64  `json:"at"`
	Value    int64  `json:"value"` // read: the value read; write: the value written
	Accepted bool   `json:"accepted"`
	// GuardValid: the guard's context was not done at the access.
	GuardValid bool `json:"guard_valid"`
	Zombie     bool `json:"zombie,omitempty"`
}

// Wait is one Acquire call: a contender waiting for a key.
type Wait struct {
	Client int    `json:"client"`
	Key    string `json:"key"`
	Start  int64  `json:"start"`
	End    int64  `json:"end"`
	Token  int64  `json:"token,omitempty"` // granted token, 0 if none
	Err    string `json:"err,omitempty"`
}

// Event kinds.
const (
	EvCrash     = "crash"      // a client stopped: no more calls, no release
	EvClockJump = "clock_jump" // the database clock stepped by D
	EvExpire    = "expire"     // an operator forced Key's lease to expire
	EvPause     = "pause"      // a holder paused for D
)

// Event is something the test did to the world.
type Event struct {
	Kind   string        `json:"kind"`
	Client int           `json:"client,omitempty"`
	Key    string        `json:"key,omitempty"`
	Token  int64         `json:"token,omitempty"`
	TTL    time.Duration `json:"ttl,omitempty"`
	At     int64         `json:"at"`
	D      time.Duration `json:"d,omitempty"`
}

// Fault is one injected fault.
type Fault struct {
	Client int    `json:"client"`
	Kind   string `json:"kind"`
	Op     OpKind `json:"op,omitempty"`
	Key    string `json:"key,omitempty"`
	At     int64  `json:"at"`
}

// Params tune the checkers for the system under test.
type Params struct {
	// Poll bounds a waiter's sleep between attempts (C-LIVE).
	Poll time.Duration `json:"poll"`
	// Eps is the scheduling slack: 0 in fake time, some ms in real time.
	Eps time.Duration `json:"eps"`
	// TokenStep1: each grant's token is exactly the previous one + 1.
	TokenStep1 bool `json:"token_step1"`
	// ClockStepsBeyondMargin: the database clock may step forward by more
	// than the margin (SIM-5); guard overlaps that follow such a step are
	// counted apart, not as anomalies.
	ClockStepsBeyondMargin bool `json:"clock_steps_beyond_margin"`
	// NoLiveness skips C-LIVE (real-time runs where it is checked apart).
	NoLiveness bool `json:"no_liveness"`
	// Permits is each semaphore's limit (C-PERMITS), by its key.
	Permits map[string]int `json:"permits,omitempty"`
}

// History is everything recorded in one run.
type History struct {
	Name     string           `json:"name"`
	Seed     uint64           `json:"seed"`
	Params   Params           `json:"params"`
	Ops      []Op             `json:"ops"`
	Audit    []Audit          `json:"audit"`
	Guards   []Guard          `json:"guards"`
	Accesses []Access         `json:"accesses"`
	Waits    []Wait           `json:"waits"`
	Events   []Event          `json:"events"`
	Faults   []Fault          `json:"faults"`
	Final    map[string]int64 `json:"final"` // the protected counter per key
}

// Hash is a SHA-256 of the history's content in a canonical order, without
// the IDs and sequence numbers that depend on which of two goroutines
// recorded first at the same instant, and with the random part that
// every sqllock.Client draws for its lease owners normalized (see
// normalizeOwners).
func (h *History) Hash() string {
	type canon struct {
		Ops      []Op
		Audit    []Audit
		Guards   []Guard
		Accesses []Access
		Waits    []Wait
		Events   []Event
		Faults   []Fault
		Final    map[string]int64
	}
	c := canon{
		Ops: append([]Op(nil), h.Ops...), Audit: append([]Audit(nil), h.Audit...),
		Guards: append([]Guard(nil), h.Guards...), Accesses: append([]Access(nil), h.Accesses...),
		Waits: append([]Wait(nil), h.Waits...), Events: append([]Event(nil), h.Events...),
		Faults: append([]Fault(nil), h.Faults...), Final: h.Final,
	}
	for i := range c.Ops {
		c.Ops[i].ID, c.Ops[i].Audit = 0, 0
	}
	for i := range c.Audit {
		c.Audit[i].Seq, c.Audit[i].Op = 0, 0
	}
	for i := range c.Guards {
		c.Guards[i].ID = 0
	}
	for i := range c.Accesses {
		c.Accesses[i].Guard = 0
	}
	sortByJSON(c.Ops)
	sortByJSON(c.Audit)
	sortByJSON(c.Guards)
	sortByJSON(c.Accesses)
	sortByJSON(c.Waits)
	sortByJSON(c.Events)
	sortByJSON(c.Faults)
	b, err := json.Marshal(c)
	if err != nil {
		panic(err)
	}
	s := sha256.Sum256(normalizeOwners(b))
	return hex.EncodeToString(s[:])
}

// ownerInstance matches a lease owner as sqllock.Client builds it:
// "<name>/<12 hex digits, random per Client>-<seq>".
var ownerInstance = regexp.MustCompile(`([^\s"\\/]+)/[0-9a-f]{12}-([0-9]+)`)

// normalizeOwners replaces the random part of every lease owner in b
// (owners, and the error texts that quote them) with one derived from the
// owner's name (its FNV-1a hash), so that two runs of one seed record and
// hash alike; names and sequence numbers, which tell owners apart, stay.
// The derived part is what the simulation's Clients drew before they drew
// at random, so seeds replay as they always did.
func normalizeOwners(b []byte) []byte {
	return ownerInstance.ReplaceAllFunc(b, func(m []byte) []byte {
		sub := ownerInstance.FindSubmatch(m)
		h := fnv.New64a()
		h.Write(sub[1])
		return fmt.Appendf(nil, "%s/%012x-%s", sub[1], h.Sum64()>>16, sub[2])
	})
}

// NormalizeOwner is owner with its random per-Client part replaced (see
// normalizeOwners): what a deterministic replay may depend on.
func NormalizeOwner(owner string) string {
	return string(normalizeOwners([]byte(owner)))
}

// sortByJSON sorts s by each element's JSON, owners normalized.
func sortByJSON[T any](s []T) {
	keys := make([]string, len(s))
	for i := range s {
		b, _ := json.Marshal(s[i])
		keys[i] = string(normalizeOwners(b))
	}
	idx := make([]int, len(s))
	for i := range idx {
		idx[i] = i
	}
	sort.SliceStable(idx, func(a, b int) bool { return keys[idx[a]] < keys[idx[b]] })
	out := make([]T, len(s))
	for i, j := range idx {
		out[i] = s[j]
	}
	copy(s, out)
}

// Recorder appends to a History; it is safe for concurrent use. Its clock
// is time.Now (fake inside a synctest bubble), relative to its creation.
type Recorder struct {
	base time.Time

	mu  sync.Mutex // guards h and seq
	h   History
	seq int64
}

// NewRecorder starts an empty history.
func NewRecorder(name string, seed uint64, p Params) *Recorder {
	return &Recorder{base: time.Now(), h: History{Name: name, Seed: seed, Params: p, Final: map[string]int64{}}}
}

// Now is the recorder's local clock: nanoseconds since its creation,
// monotonic.
func (r *Recorder) Now() int64 { return int64(time.Since(r.base)) }

// Local converts a monotonic time.Time of this process to recorder time.
func (r *Recorder) Local(t time.Time) int64 { return int64(t.Sub(r.base)) }

// BeginOp records the start of a call and returns its ID.
func (r *Recorder) BeginOp(op Op) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	op.ID = len(r.h.Ops) + 1
	op.Return = math.MaxInt64
	r.h.Ops = append(r.h.Ops, op)
	return op.ID
}

// EndOp records how a call ended.
func (r *Recorder) EndOp(id int, f func(op *Op)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f(&r.h.Ops[id-1])
}

// Apply records an applied operation and links it to its op (0: none).
// Callers that need the audit order to be the application order call it
// while holding the lock that serialises applications.
func (r *Recorder) Apply(a Audit) int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.seq++
	a.Seq = r.seq
	r.h.Audit = append(r.h.Audit, a)
	if a.Op > 0 {
		r.h.Ops[a.Op-1].Audit = a.Seq
	}
	return a.Seq
}

// AddAudit appends audit records read from a database (their Seq set).
func (r *Recorder) AddAudit(as ...Audit) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.h.Audit = append(r.h.Audit, as...)
}

// GuardStart records a new guard and returns its ID.
func (r *Recorder) GuardStart(g Guard) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	g.ID = len(r.h.Guards) + 1
	g.End = math.MaxInt64
	r.h.Guards = append(r.h.Guards, g)
	return g.ID
}

// GuardUpdate changes a recorded guard.
func (r *Recorder) GuardUpdate(id int, f func(g *Guard)) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f(&r.h.Guards[id-1])
}

// Access records an access to the protected resource.
func (r *Recorder) Access(a Access) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.h.Accesses = append(r.h.Accesses, a)
}

// Wait records one Acquire call.
func (r *Recorder) Wait(w Wait) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.h.Waits = append(r.h.Waits, w)
}

// Event records something the test did.
func (r *Recorder) Event(e Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.h.Events = append(r.h.Events, e)
}

// Fault records an injected fault.
func (r *Recorder) Fault(f Fault) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.h.Faults = append(r.h.Faults, f)
}

// SetFinal records the protected counter's final value for key.
func (r *Recorder) SetFinal(key string, v int64) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.h.Final[key] = v
}

// History returns a deep enough copy of the history so far.
func (r *Recorder) History() *History {
	r.mu.Lock()
	defer r.mu.Unlock()
	h := r.h
	h.Ops = append([]Op(nil), r.h.Ops...)
	h.Audit = append([]Audit(nil), r.h.Audit...)
	sort.SliceStable(h.Audit, func(i, j int) bool { return h.Audit[i].Seq < h.Audit[j].Seq })
	h.Guards = append([]Guard(nil), r.h.Guards...)
	h.Accesses = append([]Access(nil), r.h.Accesses...)
	h.Waits = append([]Wait(nil), r.h.Waits...)
	h.Events = append([]Event(nil), r.h.Events...)
	h.Faults = append([]Fault(nil), r.h.Faults...)
	h.Final = make(map[string]int64, len(r.h.Final))
	for k, v := range r.h.Final {
		h.Final[k] = v
	}
	return &h
}
