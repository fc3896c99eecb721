package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ashlock/ashlock/dialect/postgres"
	"github.com/ashlock/ashlock/sqllock"
)

// The release statements of the asynchronous-commit experiment. Each stays
// one statement, one round trip; only its own commit is asynchronous (the
// acquire, and renewals, stay durable).
const (
	// rawReleaseAsyncSQL sets synchronous_commit for the statement's own
	// (implicit) transaction: set_config(..., true) is SET LOCAL, read by
	// the commit that ends the statement, and reset after it.
	rawReleaseAsyncSQL = `
WITH async AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true))
UPDATE raw_locks AS l SET held = false FROM async
WHERE l.key = $1 AND l.token = $2`
)

// AsyncResult is the asynchronous-release experiment.
type AsyncResult struct {
	Cells  []Cell        `json:"cells"`
	Ratios []Ratio       `json:"ratios"`
	Checks []AsyncCheck  `json:"checks"`
	Notes  []string      `json:"notes"`
	Took   time.Duration `json:"took_ns"`
}

// AsyncCheck shows whether a release variant's commit really skipped the
// WAL flush: one connection, pairs one after another, WAL syncs counted by
// pg_stat_wal.
type AsyncCheck struct {
	Variant         string  `json:"variant"`
	Pairs           int     `json:"pairs"`
	WALSyncsPerPair float64 `json:"wal_syncs_per_pair"`
	ReleaseP50us    float64 `json:"release_p50_us"`
	ReleaseP99us    float64 `json:"release_p99_us"`
	// UnflushedPct is the share of releases after whose reply the WAL
	// was not yet flushed up to its insert position (read at once from
	// another connection): the release's commit record was not durable yet.
	UnflushedPct float64 `json:"unflushed_after_release_pct"`
	// SessionSetting is SHOW synchronous_commit on the same connection
	// after the release: the statement-local setting must not leak.
	SessionSetting string `json:"session_setting_after"`
}

func (e *pgEnv) asyncRelease(ctx context.Context, cfg *config) (*AsyncResult, error) {
	start := time.Now()
	sessionPool, err := e.newPool(ctx, int32(max(cfg.conc[len(cfg.conc)-1], 1)), map[string]string{"synchronous_commit": "off"})
	if err != nil {
		return nil, err
	}
	defer sessionPool.Close()
	m := &matrix{
		section: "async",
		contenders: []contender{
			e.rawContender("raw", rawReleaseSQL, nil),
			e.rawContender("raw-async-stmt", rawReleaseAsyncSQL, nil),
			e.rawContender("raw-async-session", rawReleaseSQL, sessionPool),
		},
		conc: cfg.conc, rounds: cfg.rounds, dur: cfg.dur * 3 / 4, probe: e, warmup: cfg.warmup(), latency: true, statementsPer: true,
	}
	res := &AsyncResult{}
	if res.Checks, err = e.asyncChecks(ctx, cfg); err != nil {
		return nil, err
	}
	if err := m.run(ctx, logf); err != nil {
		return nil, err
	}
	res.Cells = m.cells()
	for _, g := range cfg.conc {
		for _, p := range [][2]string{{"raw-async-stmt", "raw"}, {"raw-async-session", "raw"}, {"raw-async-session", "raw-async-stmt"}} {
			res.Ratios = append(res.Ratios, Ratio{Section: "async", A: p[0], B: p[1], Goroutines: g, AOverB: m.ratio(p[0], p[1], g)})
		}
	}
	res.Took = time.Since(start)
	return res, nil
}

// asyncChecks runs each release variant alone on one connection and counts
// WAL syncs per pair: a durable pair syncs twice (acquire and release), a
// pair with an asynchronous release once (plus the WAL writer's background
// flushes, a few per second).
func (e *pgEnv) asyncChecks(ctx context.Context, cfg *config) ([]AsyncCheck, error) {
	n := 300
	if cfg.quick {
		n = 150
	}
	one, err := e.newPool(ctx, 1, nil)
	if err != nil {
		return nil, err
	}
	defer one.Close()
	oneOff, err := e.newPool(ctx, 1, map[string]string{"synchronous_commit": "off"})
	if err != nil {
		return nil, err
	}
	defer oneOff.Close()
	oneBackend, err := postgres.New(one, postgres.Options{Schema: benchSchema})
	if err != nil {
		return nil, err
	}
	oneDurable, err := postgres.New(one, postgres.Options{Schema: benchSchema, DurableRelease: true})
	if err != nil {
		return nil, err
	}
	walSyncs := func() (float64, error) {
		// Backends flush their statistics lazily (up to 10 s after going
		// idle): ask both connections to flush when they next go idle.
		for _, p := range []*pgxpool.Pool{one, oneOff} {
			if _, err := p.Exec(ctx, `SELECT pg_stat_force_next_flush()`); err != nil {
				return 0, err
			}
		}
		time.Sleep(500 * time.Millisecond)
		e.adminMu.Lock()
		defer e.adminMu.Unlock()
		var v float64
		err := e.admin.QueryRow(ctx, `SELECT wal_sync::float8 FROM pg_stat_wal`).Scan(&v)
		return v, err
	}
	// unflushed reports whether WAL has been inserted but not yet flushed:
	// right after an asynchronous commit, its commit record.
	unflushed := func() (bool, error) {
		e.adminMu.Lock()
		defer e.adminMu.Unlock()
		var u bool
		err := e.admin.QueryRow(ctx, `SELECT pg_current_wal_insert_lsn() > pg_current_wal_flush_lsn()`).Scan(&u)
		return u, err
	}
	type variant struct {
		name    string
		release func(ctx context.Context, key string, token int64, l sqllock.Lease) error
		conn    *pgxpool.Pool // where SHOW runs afterwards
		ashlock bool
	}
	vs := []variant{
		{name: "raw, durable release", conn: one, release: func(ctx context.Context, key string, token int64, _ sqllock.Lease) error {
			_, err := one.Exec(ctx, rawReleaseSQL, key, token)
			return err
		}},
		{name: "raw, set_config in the release statement", conn: one, release: func(ctx context.Context, key string, token int64, _ sqllock.Lease) error {
			_, err := one.Exec(ctx, rawReleaseAsyncSQL, key, token)
			return err
		}},
		{name: "raw, release on a synchronous_commit=off session", conn: oneOff, release: func(ctx context.Context, key string, token int64, _ sqllock.Lease) error {
			_, err := oneOff.Exec(ctx, rawReleaseSQL, key, token)
			return err
		}},
		{name: "ashlock Release, DurableRelease", conn: one, ashlock: true, release: func(ctx context.Context, _ string, _ int64, l sqllock.Lease) error {
			return oneDurable.Release(ctx, l)
		}},
		{name: "ashlock Release, default", conn: one, ashlock: true, release: func(ctx context.Context, _ string, _ int64, l sqllock.Lease) error {
			return oneBackend.Release(ctx, l)
		}},
	}
	var out []AsyncCheck
	prev, err := walSyncs()
	if err != nil {
		return nil, err
	}
	for _, v := range vs {
		rel := make([]time.Duration, 0, n)
		nUnflushed := 0
		for i := range n {
			key := e.keys[i%len(e.keys)]
			var token int64
			var lease sqllock.Lease
			if v.ashlock {
				// The acquire through the ashlock statement, on the same
				// single connection.
				lease, err = oneBackend.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: e.ttl, Owner: "check"})
			} else {
				err = one.QueryRow(ctx, rawAcquireSQL, key, micros(e.ttl), "check").Scan(&token)
			}
			if err != nil {
				return nil, fmt.Errorf("%s: acquire: %w", v.name, err)
			}
			t0 := time.Now()
			if err := v.release(ctx, key, token, lease); err != nil {
				return nil, fmt.Errorf("%s: release: %w", v.name, err)
			}
			rel = append(rel, time.Since(t0))
			u, err := unflushed()
			if err != nil {
				return nil, err
			}
			if u {
				nUnflushed++
			}
		}
		var setting string
		if err := v.conn.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&setting); err != nil {
			return nil, err
		}
		cur, err := walSyncs()
		if err != nil {
			return nil, err
		}
		c := AsyncCheck{Variant: v.name, Pairs: n, WALSyncsPerPair: (cur - prev) / float64(n),
			ReleaseP50us: us(durQuantile(rel, 0.5)), ReleaseP99us: us(durQuantile(rel, 0.99)), SessionSetting: setting,
			UnflushedPct: 100 * float64(nUnflushed) / float64(n)}
		prev = cur
		logf("async check %-52s %.2f WAL syncs/pair, %.0f%% unflushed after release, release p50 %.0fµs p99 %.0fµs, then synchronous_commit=%s", v.name, c.WALSyncsPerPair, c.UnflushedPct, c.ReleaseP50us, c.ReleaseP99us, setting)
		out = append(out, c)
	}
	return out, nil
}
