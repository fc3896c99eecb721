package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/ashlock/ashlock/dialect/sqlite"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// multiKeySizes are the set sizes of the multikey section, and the limits
// of its semaphores.
var multiKeySizes = []int{1, 4, 16}

// multiKeyRatios compare the single-key pair with each set and each
// permit, as the pair's rate over theirs: what one set or permit costs in
// pairs (targets: a set of 4 keys ≤ 1.5×, a permit ≤ 1.2×).
var multiKeyRatios = func() [][2]string {
	var out [][2]string
	for _, c := range multiKeyContenders()[1:] {
		out = append(out, [2]string{"pair", c})
	}
	return out
}()

// multiKeyContenders are the contenders' names in the multikey sections.
func multiKeyContenders() []string {
	cs := []string{"pair"}
	for _, n := range multiKeySizes {
		cs = append(cs, fmt.Sprintf("set-%d", n))
	}
	for _, n := range multiKeySizes {
		cs = append(cs, fmt.Sprintf("permit-%d", n))
	}
	return cs
}

// multiKey is the multikey section on PostgreSQL: on the Backend with its
// defaults, the single-key TryAcquire + Release pair against
// TryAcquireAll of 1, 4 and 16 random keys released with one ReleaseAll,
// and a permit of semaphores of 1, 4 and 16 permits, in the same rounds.
func (e *pgEnv) multiKey(cfg *config) *matrix {
	return &matrix{
		section: "multikey", contenders: multiKeyMatrix(e.backend, e.keys, e.ttl, cfg.keys),
		conc: cfg.conc, rounds: cfg.rounds, dur: cfg.dur, probe: e, warmup: cfg.warmup(),
		latency: true, statementsPer: true,
	}
}

// multiKeySQLite is the multikey section on SQLite: the same contenders
// on a Backend with its defaults (synchronous=FULL), keys of its own table
// filled with released rows as on PostgreSQL.
func multiKeySQLite(ctx context.Context, cfg *config, tmp string) (*matrix, func(), error) {
	keys := make([]string, cfg.keys)
	for i := range keys {
		keys[i] = fmt.Sprintf("k%05d", i)
	}
	path := filepath.Join(tmp, "ashlock-multikey.db")
	b, err := sqlite.Open(path, sqlite.Options{})
	if err != nil {
		return nil, nil, err
	}
	dsn, err := sqlite.DSN(path, sqlite.Options{})
	if err == nil {
		var db *sql.DB
		if db, err = sql.Open("sqlite", dsn); err == nil {
			err = sqliteFill(ctx, db, migrations.DefaultTable, keys)
			db.Close()
		}
	}
	if err != nil {
		b.Close()
		return nil, nil, err
	}
	m := &matrix{
		section: "multikey-sqlite", contenders: multiKeyMatrix(b, keys, defaultTTL, cfg.keys),
		conc: cfg.conc, rounds: cfg.rounds, dur: cfg.dur, warmup: cfg.warmup(), latency: true,
	}
	return m, func() { b.Close() }, nil
}

// multiKeyMatrix is the contenders of a multikey section on b, in the
// order of multiKeyContenders.
func multiKeyMatrix(b sqllock.Backend, keys []string, ttl time.Duration, nkeys int) []contender {
	cs := []contender{backendContender("pair", b, keys, ttl)}
	for _, n := range multiKeySizes {
		cs = append(cs, setContender(fmt.Sprintf("set-%d", n), b, keys, ttl, n))
	}
	for _, n := range multiKeySizes {
		cs = append(cs, permitContender(fmt.Sprintf("permit-%d", n), b, ttl, n, max(1, nkeys/10)))
	}
	return cs
}

// setContender takes n distinct random keys of keys in one TryAcquireAll,
// then releases the set: with one ReleaseAll where b has it (as a
// GuardSet's Release does), else every lease at once. A set refused (a
// key another goroutine holds) is busy, not a failure.
func setContender(name string, b sqllock.Backend, keys []string, ttl time.Duration, n int) contender {
	ma := b.(sqllock.MultiAcquirer)
	mr, _ := b.(sqllock.MultiReleaser)
	return contender{name: name, newWorker: func(id int, rng *rand.Rand) pairFunc {
		owner := fmt.Sprintf("bench-set-%d", id)
		set := make([]string, 0, n)
		return func(ctx context.Context) (bool, error) {
			set = set[:0]
			for len(set) < n {
				if k := keys[rng.IntN(len(keys))]; !contains(set, k) {
					set = append(set, k)
				}
			}
			ls, err := ma.TryAcquireAll(ctx, sqllock.MultiAcquireRequest{Keys: set, TTL: ttl, Owner: owner})
			if errors.Is(err, sqllock.ErrNotAcquired) {
				return false, nil
			}
			if err != nil {
				return false, err
			}
			return true, releaseSet(ctx, b, mr, ls)
		}
	}}
}

// releaseSet releases ls with mr's ReleaseAll, or, without mr, each
// lease with its own Release, all at once.
func releaseSet(ctx context.Context, b sqllock.Backend, mr sqllock.MultiReleaser, ls []sqllock.Lease) error {
	if mr != nil {
		answers, err := mr.ReleaseAll(ctx, ls)
		if err != nil {
			return err
		}
		return errors.Join(answers...)
	}
	errs := make([]error, len(ls))
	var wg sync.WaitGroup
	for i, l := range ls {
		wg.Go(func() { errs[i] = b.Release(ctx, l) })
	}
	wg.Wait()
	return errors.Join(errs...)
}

// permitContender takes a permit of a random one of sems semaphores of
// limit n (TryAcquirePermit) and releases it. A semaphore with no free
// permit is busy, not a failure.
func permitContender(name string, b sqllock.Backend, ttl time.Duration, n, sems int) contender {
	pa := b.(sqllock.PermitAcquirer)
	return contender{name: name, newWorker: func(id int, rng *rand.Rand) pairFunc {
		owner := fmt.Sprintf("bench-permit-%d", id)
		return func(ctx context.Context) (bool, error) {
			sem := fmt.Sprintf("sem%d/%d", n, rng.IntN(sems))
			l, err := pa.TryAcquirePermit(ctx, sqllock.PermitRequest{
				AcquireRequest: sqllock.AcquireRequest{Key: sem, TTL: ttl, Owner: owner}, Permits: n})
			if errors.Is(err, sqllock.ErrNotAcquired) {
				return false, nil
			}
			if err != nil {
				return false, err
			}
			return true, b.Release(ctx, l)
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

// multiKeyMarkdown renders the multikey sections.
func (r *Report) multiKeyMarkdown(w func(string, ...any)) {
	for _, s := range []struct{ section, title, keys string }{
		{"multikey", "PostgreSQL", "random keys from the pg section's table"},
		{"multikey-sqlite", "SQLite", "random keys of a table of their own (synchronous=FULL)"},
	} {
		gs := r.concs(s.section)
		if len(gs) == 0 {
			continue
		}
		w("\n## %s: a set of keys, all or none, and permits\n\nOps/s of the Backend (defaults): a TryAcquire + Release pair of one random key; a TryAcquireAll of 1, 4 and 16 distinct random keys (one statement) and its release (one ReleaseAll); a permit of a random semaphore of 1, 4 and 16 permits (TryAcquirePermit) and its Release; %s. In parentheses: the cost in pairs (the pair's rate over the contender's, same rounds; targets: a set of 4 keys ≤ 1.5×, a permit ≤ 1.2×).\n\n", s.title, s.keys)
		stmts := s.section == "multikey"
		if stmts {
			w("| contender | %s | statements / op at %d |\n|---|%s--:|\n", cols(gs, "", false), gs[0], strings.Repeat("--:|", len(gs)))
		} else {
			w("| contender | %s |\n|---|%s\n", cols(gs, "", false), strings.Repeat("--:|", len(gs)))
		}
		for _, c := range multiKeyContenders() {
			if _, ok := r.cell(s.section, c, gs[0]); !ok {
				continue
			}
			w("| %s |", c)
			var first Cell
			for i, g := range gs {
				cell, _ := r.cell(s.section, c, g)
				if i == 0 {
					first = cell
				}
				if c == "pair" {
					w(" %s |", num(cell.OpsPerSec))
				} else {
					w(" %s (%s) |", num(cell.OpsPerSec), ratioStr(r.ratio(s.section, "pair", c, g)))
				}
			}
			if stmts {
				w(" %s |", ptr(first.StatementsPerOp, "%.2f"))
			}
			w("\n")
		}
	}
}
