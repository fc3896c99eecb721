package history

import (
	"fmt"
	"hash/fnv"
	"math"
	"sort"
	"time"

	"github.com/anishathalye/porcupine"
)

// LinInput is a porcupine operation's input.
type LinInput struct {
	Kind  OpKind
	Key   string
	Owner string
	TTL   time.Duration
	Token int64 // renew, release: the lease's token
}

// LinOutput is a porcupine operation's output. Unknown marks a call whose
// caller could not tell the outcome: its fields then come from the audit
// log when it was applied (Applied), and the model branches on both
// outcomes when the audit log cannot tell.
type LinOutput struct {
	Outcome  Outcome
	Token    int64
	DBNow    int64 // 0: not known
	Deadline int64
	Unknown  bool
	Applied  bool
}

// LinState is the model's state for one key.
type LinState struct {
	Held    bool
	Holder  string
	Token   int64
	Expires int64 // database ns
	Last    int64 // the latest token granted
}

// Model returns the per-key lock model as a porcupine model, partitioned
// by key. With step1 each grant's token must be exactly the previous one +
// 1.
func Model(step1 bool) porcupine.Model {
	nm := porcupine.NondeterministicModel{
		Partition: func(ops []porcupine.Operation) [][]porcupine.Operation {
			m := map[string][]porcupine.Operation{}
			for _, op := range ops {
				k := op.Input.(LinInput).Key
				m[k] = append(m[k], op)
			}
			var out [][]porcupine.Operation
			for _, k := range sortedKeys(m) {
				out = append(out, m[k])
			}
			return out
		},
		Init: func() []any { return []any{LinState{}} },
		Step: func(state, input, output any) []any {
			s, in, out := state.(LinState), input.(LinInput), output.(LinOutput)
			if out.Unknown && !out.Applied {
				// Not known to be applied: either it was not, or it was
				// with an outcome we cannot compute; only renew and
				// release can be applied blindly.
				next := []any{s}
				if in.Kind == Release && s.Held && in.Token == s.Token {
					n := s
					n.Held, n.Holder = false, in.Owner
					next = append(next, n)
				}
				return next
			}
			ok, n := step(s, in, out, step1)
			if !ok {
				return nil
			}
			return []any{n}
		},
		Hash: func(state any) uint64 {
			s := state.(LinState)
			h := fnv.New64a()
			fmt.Fprintf(h, "%v|%s|%d|%d|%d", s.Held, s.Holder, s.Token, s.Expires, s.Last)
			return h.Sum64()
		},
		DescribeOperation: func(input, output any) string {
			in, out := input.(LinInput), output.(LinOutput)
			u := ""
			if out.Unknown {
				u = "?"
			}
			switch in.Kind {
			case Acquire:
				return fmt.Sprintf("acquire(%s, %v) -> %s%s tok=%d db=%s dl=%s", in.Owner, in.TTL, out.Outcome, u, out.Token, dbt(out.DBNow), dbt(out.Deadline))
			case Expire:
				return fmt.Sprintf("operator expire at db=%s", dbt(out.DBNow))
			default:
				return fmt.Sprintf("%s(tok=%d) -> %s%s db=%s dl=%s", in.Kind, in.Token, out.Outcome, u, dbt(out.DBNow), dbt(out.Deadline))
			}
		},
		DescribeState: func(state any) string {
			s := state.(LinState)
			if !s.Held {
				return fmt.Sprintf("free last=%d", s.Last)
			}
			return fmt.Sprintf("held by %s tok=%d until %s last=%d", s.Holder, s.Token, dbt(s.Expires), s.Last)
		},
	}
	return nm.ToModel()
}

func ttlOK(out LinOutput, ttl time.Duration) bool {
	if out.DBNow == 0 || ttl == 0 {
		return true
	}
	d := time.Duration(out.Deadline - out.DBNow)
	return d >= ttl && d <= ttl+time.Millisecond // backends round up to their resolution
}

func step(s LinState, in LinInput, out LinOutput, step1 bool) (bool, LinState) {
	known := out.DBNow != 0
	live := s.Held && (!known || out.DBNow < s.Expires)
	switch in.Kind {
	case Expire:
		s.Expires = out.DBNow
		return true, s
	case Acquire:
		switch out.Outcome {
		case OK:
			if !ttlOK(out, in.TTL) {
				return false, s
			}
			if s.Held && known && out.DBNow < s.Expires {
				if s.Holder != in.Owner || out.Token != s.Token {
					return false, s
				}
				s.Expires = out.Deadline
				return true, s
			}
			if out.Token <= s.Last || (step1 && out.Token != s.Last+1) {
				return false, s
			}
			return true, LinState{Held: true, Holder: in.Owner, Token: out.Token, Expires: out.Deadline, Last: out.Token}
		case Held:
			return live && s.Holder != in.Owner, s
		default:
			return true, s
		}
	case Renew:
		valid := s.Held && in.Token == s.Token && known && out.DBNow < s.Expires
		switch out.Outcome {
		case OK:
			if !valid || !ttlOK(out, in.TTL) {
				return false, s
			}
			s.Expires = out.Deadline
			return true, s
		case Lost:
			return !valid || !known, s
		default:
			return true, s
		}
	case Release:
		switch {
		case in.Token == s.Token && s.Held:
			valid := !known || out.DBNow < s.Expires
			expired := !known || out.DBNow >= s.Expires
			if (out.Outcome == OK && !valid) || (out.Outcome == Lost && !expired) {
				return false, s
			}
			s.Held, s.Holder = false, in.Owner
			return true, s
		case in.Token == s.Token:
			// Released before: a repeat by whoever released it is
			// harmless, anyone else's is told the lease was lost.
			return (out.Outcome == OK) == (s.Holder == in.Owner), s
		default:
			return out.Outcome == Lost, s
		}
	}
	return false, s
}

// LinOperations turns h into porcupine operations. Calls that the caller
// could not tell and the audit log shows were not applied are dropped
// (etcd's patching); those it shows applied take the audit's outcome and
// return at +∞. With auditComplete false, an unknown call missing from the
// audit log is kept, and the model branches on it.
func LinOperations(h *History, auditComplete bool) []porcupine.Operation {
	audit := map[int64]Audit{}
	for _, a := range h.Audit {
		audit[a.Seq] = a
	}
	var ops []porcupine.Operation
	maxClient := 0
	for _, op := range h.Ops {
		maxClient = max(maxClient, op.Client)
		if op.Outcome == Invalid {
			continue
		}
		in := LinInput{Kind: op.Kind, Key: op.Key, Owner: op.Owner, TTL: op.TTL}
		if op.Kind != Acquire {
			in.Token = op.Token
		}
		out := LinOutput{Outcome: op.Outcome, Token: op.Token, DBNow: op.DBNow, Deadline: op.Deadline}
		ret := op.Return
		a, applied := audit[op.Audit]
		applied = applied && op.Audit != 0
		if op.Outcome.Unknown() {
			ret = math.MaxInt64
			out = LinOutput{Unknown: true}
			if applied && a.At >= op.Call {
				// The audit log says when it took effect (etcd bounds
				// the return time of persisted failed writes the same
				// way); without that, the search space explodes.
				ret = a.At
			}
			if applied {
				out = LinOutput{Outcome: a.Outcome, Token: a.Token, DBNow: a.DBNow, Deadline: a.Deadline, Unknown: true, Applied: true}
				if op.Kind != Acquire {
					out.Token = 0
				}
			} else if auditComplete {
				continue
			}
		} else if applied && out.DBNow == 0 {
			out.DBNow, out.Deadline = a.DBNow, a.Deadline
		}
		if op.Kind != Acquire && !out.Unknown {
			out.Token = 0
		}
		ops = append(ops, porcupine.Operation{ClientId: op.Client, Input: in, Call: op.Call, Output: out, Return: ret})
	}
	for _, a := range h.Audit {
		if a.Kind == Expire {
			ops = append(ops, porcupine.Operation{ClientId: maxClient + 1, Input: LinInput{Kind: Expire, Key: a.Key},
				Call: a.At, Output: LinOutput{Outcome: OK, DBNow: a.DBNow}, Return: a.At})
		}
	}
	sort.SliceStable(ops, func(i, j int) bool { return ops[i].Call < ops[j].Call })
	return ops
}

// CheckLin (C-LIN) checks h with porcupine and records the verdict in r
// (a failed check is repeated with CheckOperationsVerbose for the
// visualisation);
// "Unknown" (timeout) counts as a failure, as in etcd. It returns the model
// and the info for [porcupine.VisualizePath].
func CheckLin(h *History, r *Report, auditComplete bool, timeout time.Duration) (porcupine.Model, porcupine.LinearizationInfo) {
	model := Model(h.Params.TokenStep1)
	ops := LinOperations(h, auditComplete)
	start := time.Now()
	res := porcupine.CheckOperationsTimeout(model, ops, timeout)
	var info porcupine.LinearizationInfo
	if res != porcupine.Ok {
		// Again, verbose, for the visualisation.
		res, info = porcupine.CheckOperationsVerbose(model, ops, timeout)
	}
	r.LinTime, r.Lin, r.LinOps = time.Since(start), string(res), len(ops)
	if res != porcupine.Ok {
		r.add(CLin, "", 0, "porcupine: %s over %d operations (see history.html)", res, len(ops))
	}
	return model, info
}
