package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"cirello.io/pglock"
	"github.com/jackc/pgx/v5"

	"github.com/ashlock/ashlock/internal/lockbench"
	"github.com/ashlock/ashlock/sqllock"
)

// hotKey builds the contended-TryAcquire matrix: every contender hammers
// one key that someone else holds, and each attempt fails. The probe shows
// what a failed attempt costs the database (WAL bytes, transaction ids).
func (e *pgEnv) hotKey(ctx context.Context, cfg *config) (*matrix, error) {
	const hold = time.Hour
	// The holders.
	if _, err := e.backend.TryAcquire(ctx, sqllock.AcquireRequest{Key: "hot-ashlock", TTL: hold, Owner: "holder"}); err != nil {
		return nil, err
	}
	var tok int64
	if err := e.pool.QueryRow(ctx, rawAcquireSQL, "hot-raw", micros(hold), "holder").Scan(&tok); err != nil {
		return nil, err
	}
	holderPG, err := pglock.New(e.pglockDB, pglock.WithCustomTable("pglock_locks"))
	if err != nil {
		return nil, err
	}
	hl, err := holderPG.AcquireContext(ctx, "hot-pglock", pglock.FailIfLocked())
	if err != nil {
		return nil, fmt.Errorf("pglock holder: %w", err)
	}
	e.keep = append(e.keep, func() { _ = holderPG.Release(hl) })
	// The advisory holder keeps its own session (and lock) for the rest of
	// the run: e keeps it reachable (an unreachable connection's socket is
	// closed by its finalizer, and the lock with it) and closes it.
	advConn, err := pgx.Connect(ctx, e.url)
	if err != nil {
		return nil, err
	}
	e.keep = append(e.keep, func() { advConn.Close(context.Background()) })
	const hotAdv = advisoryBase - 1
	var ok bool
	if err := advConn.QueryRow(ctx, `SELECT pg_try_advisory_lock($1)`, hotAdv).Scan(&ok); err != nil || !ok {
		return nil, fmt.Errorf("advisory holder: %v %v", ok, err)
	}
	owner := func(id int) string { return fmt.Sprintf("waiter-%d", id) }
	ttl := micros(e.ttl)
	cs := []contender{
		{name: "backend", newWorker: func(id int, _ *rand.Rand) pairFunc {
			return lockbench.Attempt(e.backend, "hot-ashlock", e.ttl, lockbench.Owner(owner(id)))
		}},
		{name: "raw-upsert", newWorker: func(id int, _ *rand.Rand) pairFunc {
			return func(ctx context.Context) (bool, error) {
				var t int64
				err := e.pool.QueryRow(ctx, rawAcquireSQL, "hot-raw", ttl, owner(id)).Scan(&t)
				if errors.Is(err, pgx.ErrNoRows) {
					return false, nil
				}
				if err == nil {
					return true, lockbench.ErrStole
				}
				return false, err
			}
		}},
		{name: "raw-update", newWorker: func(id int, _ *rand.Rand) pairFunc {
			return func(ctx context.Context) (bool, error) {
				var t int64
				err := e.pool.QueryRow(ctx, rawUpdateAcquireSQL, "hot-raw", ttl, owner(id)).Scan(&t)
				if errors.Is(err, pgx.ErrNoRows) {
					return false, nil
				}
				if err == nil {
					return true, lockbench.ErrStole
				}
				return false, err
			}
		}},
		{name: "pglock", newWorker: func(id int, _ *rand.Rand) pairFunc {
			return func(ctx context.Context) (bool, error) {
				_, err := e.pglock.AcquireContext(ctx, "hot-pglock", pglock.FailIfLocked())
				if errors.Is(err, pglock.ErrNotAcquired) {
					return false, nil
				}
				if err == nil {
					return true, lockbench.ErrStole
				}
				return false, err
			}
		}},
		{name: "advisory", newWorker: func(id int, _ *rand.Rand) pairFunc {
			return func(ctx context.Context) (bool, error) {
				var ok bool
				if err := e.pool.QueryRow(ctx, `SELECT pg_try_advisory_lock($1)`, hotAdv).Scan(&ok); err != nil {
					return false, err
				}
				if ok {
					return true, lockbench.ErrStole
				}
				return false, nil
			}
		}},
	}
	conc := []int{1, 16}
	d := cfg.dur / 2
	return &matrix{section: "hotkey", contenders: cs, conc: conc, rounds: cfg.rounds, dur: d, probe: e, warmup: cfg.warmup(),
		latency: true, countBusy: true, statementsPer: true, noStatements: map[string]bool{"pglock": true}}, nil
}
