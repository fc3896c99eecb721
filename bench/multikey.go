package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"

	"github.com/ashlock/ashlock/sqllock"
)

// multiKeySizes are the set sizes of the multikey section.
var multiKeySizes = []int{1, 4, 16}

// multiKeyRatios compare the single-key pair with each set, as the pair's
// rate over the set's: what one set costs in pairs (target for 4 keys:
// ≤ 1.5×).
var multiKeyRatios = func() [][2]string {
	var out [][2]string
	for _, n := range multiKeySizes {
		out = append(out, [2]string{"pair", fmt.Sprintf("set-%d", n)})
	}
	return out
}()

// multiKey is the multikey section: on the Backend with its defaults, the
// single-key TryAcquire + Release pair against TryAcquireAll of 1, 4 and
// 16 random keys and the release of each of its leases, sent at once (so
// that the group commit carries them in one statement), in the same
// rounds.
func (e *pgEnv) multiKey(cfg *config) *matrix {
	cs := []contender{backendContender("pair", e.backend, e.keys, e.ttl)}
	for _, n := range multiKeySizes {
		cs = append(cs, e.setContender(fmt.Sprintf("set-%d", n), n))
	}
	return &matrix{
		section: "multikey", contenders: cs,
		conc: cfg.conc, rounds: cfg.rounds, dur: cfg.dur, probe: e, warmup: cfg.warmup(),
		latency: true, statementsPer: true,
	}
}

// setContender takes n distinct random keys of e.keys in one
// TryAcquireAll, then releases every lease at once. A set refused (a key
// another goroutine holds) is busy, not a failure.
func (e *pgEnv) setContender(name string, n int) contender {
	return contender{name: name, newWorker: func(id int, rng *rand.Rand) pairFunc {
		owner := fmt.Sprintf("bench-set-%d", id)
		keys := make([]string, 0, n)
		return func(ctx context.Context) (bool, error) {
			keys = keys[:0]
			for len(keys) < n {
				if k := e.keys[rng.IntN(len(e.keys))]; !contains(keys, k) {
					keys = append(keys, k)
				}
			}
			ls, err := e.backend.TryAcquireAll(ctx, sqllock.MultiAcquireRequest{Keys: keys, TTL: e.ttl, Owner: owner})
			if errors.Is(err, sqllock.ErrNotAcquired) {
				return false, nil
			}
			if err != nil {
				return false, err
			}
			errs := make([]error, len(ls))
			var wg sync.WaitGroup
			for i, l := range ls {
				wg.Go(func() { errs[i] = e.backend.Release(ctx, l) })
			}
			wg.Wait()
			return true, errors.Join(errs...)
		}
	}}
}

func contains(keys []string, k string) bool {
	for _, x := range keys {
		if x == k {
			return true
		}
	}
	return false
}

// multiKeyMarkdown renders the multikey section.
func (r *Report) multiKeyMarkdown(w func(string, ...any), gs []int) {
	w("\n## PostgreSQL: a set of keys, all or none\n\nOps/s of the Backend (defaults): a TryAcquire + Release pair of one random key, and a TryAcquireAll of 1, 4 and 16 distinct random keys (one statement) with the release of each lease sent at once; random keys from the pg section's table. In parentheses: the set's cost in pairs (the pair's rate over the set's, same rounds; target for 4 keys ≤ 1.5×).\n\n| contender | %s | statements / op at %d |\n|---|%s--:|\n", cols(gs, "", false), gs[0], strings.Repeat("--:|", len(gs)))
	cs := []string{"pair"}
	for _, n := range multiKeySizes {
		cs = append(cs, fmt.Sprintf("set-%d", n))
	}
	for _, c := range cs {
		if _, ok := r.cell("multikey", c, gs[0]); !ok {
			continue
		}
		w("| %s |", c)
		var first Cell
		for i, g := range gs {
			cell, _ := r.cell("multikey", c, g)
			if i == 0 {
				first = cell
			}
			if c == "pair" {
				w(" %s |", num(cell.OpsPerSec))
			} else {
				w(" %s (%s) |", num(cell.OpsPerSec), ratioStr(r.ratio("multikey", "pair", c, g)))
			}
		}
		w(" %s |\n", ptr(first.StatementsPerOp, "%.2f"))
	}
}
