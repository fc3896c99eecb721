package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"github.com/bsm/redislock"
	"github.com/go-redsync/redsync/v4"
	"github.com/go-redsync/redsync/v4/redis/goredis/v9"
	"github.com/redis/go-redis/v9"

	"github.com/ashlock/ashlock/internal/lockbench"
	"github.com/ashlock/ashlock/sqllock"
)

// redisEnv is the redis section's servers (one per durability) and their
// clients; the ashlock contenders it is compared with come from the
// PostgreSQL section's pgEnv.
type redisEnv struct {
	version string
	servers map[redisDurability]*redisServer
	clients map[redisDurability]*redis.Client
	keys    []string
	ttl     time.Duration
	sent    cmdCounter // round trips of all clients
}

// startRedisEnv starts one redis-server per durability under dir. pool is
// the go-redis pool size (the largest concurrency, as the pgx pool's).
func startRedisEnv(ctx context.Context, bin, dir string, pool int, keys []string, ttl time.Duration) (*redisEnv, error) {
	e := &redisEnv{servers: map[redisDurability]*redisServer{}, clients: map[redisDurability]*redis.Client{}, keys: keys, ttl: ttl}
	for _, d := range redisDurabilities {
		begin := time.Now()
		s, err := startRedis(ctx, bin, dir, d)
		if err != nil {
			e.close()
			return nil, err
		}
		e.servers[d] = s
		c := redis.NewClient(&redis.Options{Addr: s.addr, PoolSize: pool, MinIdleConns: pool})
		c.AddHook(&e.sent)
		e.clients[d] = c
		logf("started %s (durability %s) on %s in %s in %v", bin, d, s.addr, s.dir, time.Since(begin).Round(time.Millisecond))
	}
	info, err := e.clients[redisNone].Info(ctx, "server").Result()
	if err != nil {
		e.close()
		return nil, err
	}
	e.version = infoField(info, "redis_version")
	return e, nil
}

func (e *redisEnv) close() {
	for _, c := range e.clients {
		c.Close()
	}
	for _, s := range e.servers {
		s.stop()
	}
}

// cmdCounter is a go-redis hook counting the round trips a client makes:
// one per command, one per pipeline (commands a script runs inside the
// server are not round trips, and not counted).
type cmdCounter struct{ n atomic.Int64 }

func (c *cmdCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (c *cmdCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmd)
	}
}

func (c *cmdCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		c.n.Add(1)
		return next(ctx, cmds)
	}
}

// redisProbe counts, for a matrix mixing ashlock on PostgreSQL and the
// Redis locks, the statements pgx sent plus the Redis clients' round trips:
// only one contender runs at a time, so the sum is the running one's.
type redisProbe struct {
	pg *pgEnv
	r  *redisEnv
}

func (p redisProbe) read(ctx context.Context) counters {
	c := p.pg.read(ctx)
	c.statements += float64(p.r.sent.n.Load())
	return c
}

// redislockPair: Obtain with redislock's default (no retry), then Release.
func (e *redisEnv) redislockPair(name string, d redisDurability) contender {
	lc := redislock.New(e.clients[d])
	return contender{name: name, newWorker: func(id int, rng *rand.Rand) pairFunc {
		return func(ctx context.Context) (bool, error) {
			l, err := lc.Obtain(ctx, "rl:"+e.keys[rng.IntN(len(e.keys))], e.ttl, nil)
			if errors.Is(err, redislock.ErrNotObtained) {
				return false, nil
			}
			if err != nil {
				return false, err
			}
			return true, l.Release(ctx)
		}
	}}
}

// redsyncPair: TryLockContext (one try) on a one-pool Redsync, then
// UnlockContext.
func (e *redisEnv) redsyncPair(name string, d redisDurability) contender {
	rs := redsync.New(goredis.NewPool(e.clients[d]))
	return contender{name: name, newWorker: func(id int, rng *rand.Rand) pairFunc {
		return func(ctx context.Context) (bool, error) {
			m := rs.NewMutex("rs:"+e.keys[rng.IntN(len(e.keys))], redsync.WithExpiry(e.ttl))
			err := m.TryLockContext(ctx)
			if isRedsyncTaken(err) {
				return false, nil
			}
			if err != nil {
				return false, err
			}
			ok, err := m.UnlockContext(ctx)
			if err == nil && !ok {
				err = errors.New("redsync: Unlock found the lock not held")
			}
			return true, err
		}
	}}
}

// isRedsyncTaken: redsync's answer for a key someone else holds.
func isRedsyncTaken(err error) bool {
	var taken *redsync.ErrTaken
	return errors.As(err, &taken)
}

var redisRatios = [][2]string{
	{"backend-durable", "redislock-always"}, {"backend-durable", "redsync-always"},
	{"backend", "redislock-everysec"}, {"backend", "redsync-everysec"},
	{"backend", "redislock-none"}, {"backend", "redsync-none"},
	{"redislock-everysec", "redislock-always"}, {"redislock-none", "redislock-always"},
	{"redsync-everysec", "redsync-always"}, {"redsync-none", "redsync-always"},
}

// throughput: TryAcquire + Release pairs of random keys, ashlock's Backend
// on PostgreSQL (defaults and DurableRelease) interleaved with redislock
// and redsync on each durability.
func (e *redisEnv) throughput(cfg *config, pe *pgEnv) *matrix {
	cs := []contender{
		backendContender("backend-durable", pe.backendDurable, pe.keys, pe.ttl),
		backendContender("backend", pe.backend, pe.keys, pe.ttl),
	}
	for _, d := range redisDurabilities {
		cs = append(cs, e.redislockPair("redislock-"+string(d), d), e.redsyncPair("redsync-"+string(d), d))
	}
	return &matrix{section: "redis", contenders: cs, conc: cfg.conc, rounds: cfg.rounds, dur: cfg.dur,
		probe: redisProbe{pe, e}, warmup: cfg.warmup(), latency: true, statementsPer: true}
}

// hotKey: attempts on a key someone else holds (a TTL of an hour), on the
// appendfsync-always server (a refused SET NX writes nothing to the AOF)
// and ashlock's TryAcquire on PostgreSQL.
func (e *redisEnv) hotKey(ctx context.Context, cfg *config, pe *pgEnv) (*matrix, error) {
	const hold = time.Hour
	if _, err := pe.backend.TryAcquire(ctx, sqllock.AcquireRequest{Key: "hot-redis-ashlock", TTL: hold, Owner: "holder"}); err != nil {
		return nil, err
	}
	c := e.clients[redisAlways]
	if _, err := redislock.New(c).Obtain(ctx, "rl:hot", hold, nil); err != nil {
		return nil, fmt.Errorf("redislock holder: %w", err)
	}
	rs := redsync.New(goredis.NewPool(c))
	if err := rs.NewMutex("rs:hot", redsync.WithExpiry(hold)).TryLockContext(ctx); err != nil {
		return nil, fmt.Errorf("redsync holder: %w", err)
	}
	lc := redislock.New(c)
	cs := []contender{
		{name: "backend", newWorker: func(id int, _ *rand.Rand) pairFunc {
			return lockbench.Attempt(pe.backend, "hot-redis-ashlock", pe.ttl, lockbench.Owner(fmt.Sprintf("w%d", id)))
		}},
		{name: "redislock", newWorker: func(int, *rand.Rand) pairFunc {
			return func(ctx context.Context) (bool, error) {
				_, err := lc.Obtain(ctx, "rl:hot", e.ttl, nil)
				return hotResult(errors.Is(err, redislock.ErrNotObtained), err)
			}
		}},
		{name: "redsync", newWorker: func(int, *rand.Rand) pairFunc {
			return func(ctx context.Context) (bool, error) {
				err := rs.NewMutex("rs:hot", redsync.WithExpiry(e.ttl)).TryLockContext(ctx)
				return hotResult(isRedsyncTaken(err), err)
			}
		}},
	}
	return &matrix{section: "redis-hotkey", contenders: cs, conc: []int{1, 16}, rounds: cfg.rounds, dur: cfg.dur / 2,
		probe: redisProbe{pe, e}, warmup: cfg.warmup(), latency: true, countBusy: true, statementsPer: true}, nil
}

// hotResult is a hot-key attempt's outcome: refused is what every attempt
// must be; a grant means two holders at once.
func hotResult(refused bool, err error) (bool, error) {
	switch {
	case refused:
		return false, nil
	case err == nil:
		return true, lockbench.ErrStole
	}
	return false, err
}

// handoff: a holder releases after 20–120 ms while a waiter waits; from
// just before the release to the waiter's grant. ashlock (PostgreSQL,
// LISTEN/NOTIFY) against redislock polling with LinearBackoff (its best
// strategy for a handoff: ExponentialBackoff, its other one, waits
// 16, 16, 16, 32, 64, 128 ms... between tries, so a release lands in a
// long gap) and with ExponentialBackoff(16 ms, 512 ms) (its README's
// minimum), and redsync's Lock with its defaults (32 tries, 50–250 ms
// apart), all on the appendfsync-everysec server, interleaved.
func (e *redisEnv) handoff(ctx context.Context, cfg *config, pe *pgEnv) ([]Latency, error) {
	n := 60
	if cfg.quick {
		n = 20
	}
	h, err := pe.side(ctx, "holder", true)
	if err != nil {
		return nil, err
	}
	defer h.close()
	w, err := pe.side(ctx, "waiter", true)
	if err != nil {
		return nil, err
	}
	defer w.close()
	c := e.clients[redisEverysec]
	lc := redislock.New(c)
	rs := redsync.New(goredis.NewPool(c))
	type variant struct {
		name, note string
		one        func(ctx context.Context, key string, hold time.Duration) (time.Duration, error)
		ds         []time.Duration
		errs       int
	}
	redislockVariant := func(name, note string, strategy func() redislock.RetryStrategy) *variant {
		return &variant{name: name, note: note, one: func(ctx context.Context, key string, hold time.Duration) (time.Duration, error) {
			return redislockHandoff(ctx, lc, "rl:"+key, e.ttl, hold, strategy())
		}}
	}
	vs := []*variant{
		{name: "ashlock Client (PostgreSQL, defaults)", note: "LISTEN/NOTIFY wake-up", one: func(ctx context.Context, key string, hold time.Duration) (time.Duration, error) {
			return oneHandoff(ctx, h.client, w.client, "redis-"+key, hold)
		}},
		redislockVariant("redislock, LinearBackoff(5 ms)", "polls every 5 ms", func() redislock.RetryStrategy { return redislock.LinearBackoff(5 * time.Millisecond) }),
		redislockVariant("redislock, ExponentialBackoff(16 ms, 512 ms)", "its recommended minimum", func() redislock.RetryStrategy {
			return redislock.ExponentialBackoff(16*time.Millisecond, 512*time.Millisecond)
		}),
		{name: "redsync Lock, defaults", note: "32 tries, 50–250 ms apart", one: func(ctx context.Context, key string, hold time.Duration) (time.Duration, error) {
			return redsyncHandoff(ctx, rs, "rs:"+key, e.ttl, hold)
		}},
	}
	rng := rand.New(rand.NewPCG(17, 19))
	for i := range n {
		for k := range vs {
			v := vs[(i+k)%len(vs)]
			d, err := v.one(ctx, fmt.Sprintf("h%d", i), handoffHold(rng))
			if err != nil {
				if ctx.Err() != nil {
					return nil, ctx.Err()
				}
				v.errs++
				logf("redis handoff %s: %v", v.name, err)
				continue
			}
			v.ds = append(v.ds, d)
		}
	}
	var out []Latency
	for _, v := range vs {
		logf("redis handoff %-45s p50 %v p99 %v", v.name, durQuantile(v.ds, 0.5), durQuantile(v.ds, 0.99))
		out = append(out, newLatency("redis", v.name, v.note, v.ds, v.errs))
	}
	return out, nil
}

func redislockHandoff(ctx context.Context, lc *redislock.Client, key string, ttl, hold time.Duration, retry redislock.RetryStrategy) (time.Duration, error) {
	hl, err := lc.Obtain(ctx, key, ttl, nil)
	if err != nil {
		return 0, fmt.Errorf("holder: %w", err)
	}
	type result struct {
		at time.Time
		l  *redislock.Lock
		e  error
	}
	got := make(chan result, 1)
	go func() {
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		l, err := lc.Obtain(wctx, key, ttl, &redislock.Options{RetryStrategy: retry})
		got <- result{time.Now(), l, err}
	}()
	time.Sleep(hold)
	t0 := time.Now()
	if err := hl.Release(ctx); err != nil {
		return 0, fmt.Errorf("holder release: %w", err)
	}
	r := <-got
	if r.e != nil {
		return 0, fmt.Errorf("waiter: %w", r.e)
	}
	if err := r.l.Release(ctx); err != nil {
		return 0, err
	}
	return r.at.Sub(t0), nil
}

func redsyncHandoff(ctx context.Context, rs *redsync.Redsync, key string, ttl, hold time.Duration) (time.Duration, error) {
	hm := rs.NewMutex(key, redsync.WithExpiry(ttl))
	if err := hm.TryLockContext(ctx); err != nil {
		return 0, fmt.Errorf("holder: %w", err)
	}
	type result struct {
		at time.Time
		m  *redsync.Mutex
		e  error
	}
	got := make(chan result, 1)
	go func() {
		wm := rs.NewMutex(key, redsync.WithExpiry(ttl))
		err := wm.LockContext(ctx)
		got <- result{time.Now(), wm, err}
	}()
	time.Sleep(hold)
	t0 := time.Now()
	if ok, err := hm.UnlockContext(ctx); err != nil || !ok {
		return 0, fmt.Errorf("holder unlock: %v %v", ok, err)
	}
	r := <-got
	if r.e != nil {
		return 0, fmt.Errorf("waiter: %w", r.e)
	}
	if ok, err := r.m.UnlockContext(ctx); err != nil || !ok {
		return 0, fmt.Errorf("waiter unlock: %v %v", ok, err)
	}
	return r.at.Sub(t0), nil
}

// RedisResult is what the redis section measured beyond its matrices, or
// why it did not run.
type RedisResult struct {
	Skipped string    `json:"skipped,omitempty"`
	Version string    `json:"version,omitempty"`
	Handoff []Latency `json:"handoff,omitempty"`
}

// redisSection starts the servers, runs the throughput and hot-key
// matrices and the handoff, and stops the servers.
func redisSection(ctx context.Context, cfg *config, pe *pgEnv, bin, tmp string, rep *Report) (*RedisResult, error) {
	keys := pe.keys
	e, err := startRedisEnv(ctx, bin, tmp, slices.Max(cfg.conc), keys, pe.ttl)
	if err != nil {
		return nil, err
	}
	defer e.close()
	res := &RedisResult{Version: e.version}
	m := e.throughput(cfg, pe)
	if err := m.run(ctx, logf); err != nil {
		return nil, err
	}
	rep.addMatrix(m, redisRatios)
	hm, err := e.hotKey(ctx, cfg, pe)
	if err != nil {
		return nil, fmt.Errorf("hot key: %w", err)
	}
	if err := hm.run(ctx, logf); err != nil {
		return nil, err
	}
	rep.addMatrix(hm, [][2]string{{"backend", "redislock"}, {"backend", "redsync"}})
	if res.Handoff, err = e.handoff(ctx, cfg, pe); err != nil {
		return nil, fmt.Errorf("handoff: %w", err)
	}
	return res, nil
}

// redisRows is the throughput table's order: each durability's ashlock
// counterpart first (none for "no durability").
var redisRows = []struct{ durability, contender, peer string }{
	{"durable", "backend-durable", ""},
	{"durable", "redislock-always", "backend-durable"},
	{"durable", "redsync-always", "backend-durable"},
	{"asynchronous", "backend", ""},
	{"asynchronous", "redislock-everysec", "backend"},
	{"asynchronous", "redsync-everysec", "backend"},
	{"no durability", "redislock-none", ""},
	{"no durability", "redsync-none", ""},
}

func init() {
	for k, v := range map[string]string{
		"redis|backend-durable":    "ashlock Backend on PostgreSQL, DurableRelease",
		"redis|backend":            "ashlock Backend on PostgreSQL, defaults (asynchronous release)",
		"redis|redislock-always":   "redislock, appendfsync always",
		"redis|redsync-always":     "redsync, appendfsync always",
		"redis|redislock-everysec": "redislock, appendfsync everysec",
		"redis|redsync-everysec":   "redsync, appendfsync everysec",
		"redis|redislock-none":     "redislock, persistence off",
		"redis|redsync-none":       "redsync, persistence off",

		"redis-hotkey|backend":   "ashlock TryAcquire (PostgreSQL)",
		"redis-hotkey|redislock": "redislock Obtain, no retry",
		"redis-hotkey|redsync":   "redsync TryLock",
	} {
		names[k] = v
	}
}

// redisNotGiven: what the Redis locks do not give, one line each.
var redisNotGiven = []string{
	"**Fencing**: no fencing token. redislock's token and redsync's value are random strings, not a number that grows per key, so a store cannot refuse the write of a holder whose lock has expired and been granted again; ashlock's per-key token only grows and its fenced writes check it.",
	"**Failover safety**: Redis replicates asynchronously, so a replica promoted after the primary dies can lack the last `SET NX` and grant the same lock a second time (and one server restarted under `everysec` or without persistence forgets up to a second of, or all, its locks); redsync's Redlock over several independent primaries narrows this only under bounded clock drift and pauses.",
	"**Database clock**: the TTL does run on the Redis server's clock (`PX`), but with no fencing nothing stops a client that paused past that expiry from acting on, and writing under, a lock it no longer holds; ashlock's guard ends at a local deadline counted from before the request, and the fence refuses the late write.",
}

func (r *Report) redisMarkdown(w func(string, ...any)) {
	w("\n## Redis locks: `bsm/redislock` and `go-redsync/redsync`, paired by durability\n\n")
	if r.Redis.Skipped != "" {
		w("Not measured: %s.\n", r.Redis.Skipped)
		return
	}
	gs := r.concs("redis")
	if len(gs) == 0 {
		return
	}
	e := r.Env
	w("Three throwaway Redis %s servers started from the machine's `redis-server`, on loopback, data directories on the temp file system, no RDB snapshots: `appendonly yes` + `appendfsync always` (paired with ashlock's `DurableRelease`), `appendonly yes` + `appendfsync everysec` (paired with ashlock's default asynchronous release), and persistence off (no durability). redislock %s: `Obtain` (no retry) + `Release`; redsync %s on the go-redis pool (one pool, quorum 1): `TryLockContext` + `UnlockContext`; go-redis %s, a pool as large as the largest concurrency. Random keys of %s, 30 s TTL; ashlock's Backend on this run's PostgreSQL, interleaved with them in the same rounds.\n\n",
		r.Redis.Version, e.Modules["github.com/bsm/redislock"], e.Modules["github.com/go-redsync/redsync/v4"], e.Modules["github.com/redis/go-redis/v9"], num(float64(r.Keys)))
	w("What the Redis locks do not give:\n\n")
	for _, l := range redisNotGiven {
		w("- %s\n", l)
	}
	w("\nPairs/s; in parentheses, ashlock's rate of the same durability divided by this one's, same rounds:\n\n| durability | contender | %s |\n|---|---|%s\n", cols(gs, "", false), strings.Repeat("--:|", len(gs)))
	for _, row := range redisRows {
		w("| %s | %s |", row.durability, name("redis", row.contender))
		for _, g := range gs {
			cell, ok := r.cell("redis", row.contender, g)
			switch {
			case !ok:
				w(" – |")
			case row.peer == "":
				w(" %s |", num(cell.OpsPerSec))
			default:
				w(" %s (%s) |", num(cell.OpsPerSec), ratioStr(r.ratio("redis", row.peer, row.contender, g)))
			}
		}
		w("\n")
	}
	w("\nLatency of one pair, p50 / p99 in ms, and round trips per pair (pgx statements for ashlock, commands the Redis clients sent for the others; medians over rounds):\n\n| contender | %s | per pair at %d / %d |\n|---|%s--:|\n", cols(gs, "", true), gs[0], gs[len(gs)-1], strings.Repeat("--:|", len(gs)))
	for _, row := range redisRows {
		w("| %s |", name("redis", row.contender))
		for _, g := range gs {
			cell, _ := r.cell("redis", row.contender, g)
			w(" %s / %s |", msStr(cell.P50us), msStr(cell.P99us))
		}
		a, b := findCellIn(r.Cells, "redis", row.contender, gs[0]), findCellIn(r.Cells, "redis", row.contender, gs[len(gs)-1])
		w(" %s / %s |\n", ptr(a.StatementsPerOp, "%.2f"), ptr(b.StatementsPerOp, "%.2f"))
	}
	if hs := r.concs("redis-hotkey"); len(hs) > 0 {
		w("\nRefused attempts on a key someone else holds (Redis: the `appendfsync always` server; a refused `SET NX` writes nothing to the AOF):\n\n| attempt | %s | p50 at %d (ms) | round trips / attempt |\n|---|%s--:|--:|\n", cols(hs, ", attempts/s", false), hs[0], strings.Repeat("--:|", len(hs)))
		for _, c := range []string{"backend", "redislock", "redsync"} {
			w("| %s |", name("redis-hotkey", c))
			for _, g := range hs {
				cell, _ := r.cell("redis-hotkey", c, g)
				w(" %s |", num(cell.OpsPerSec))
			}
			first := findCellIn(r.Cells, "redis-hotkey", c, hs[0])
			w(" %s | %s |\n", msStr(first.P50us), ptr(first.StatementsPerOp, "%.2f"))
		}
		w("\nredsync's refused `TryLock` sends its release script after the refused `SET NX` (it releases whatever it may have set on every pool), hence two round trips.\n")
	}
	if len(r.Redis.Handoff) > 0 {
		w("\nHandoff (a holder releases after 20–120 ms while a waiter waits; from just before the release to the waiter's grant; the Redis locks on the `appendfsync everysec` server, ashlock on PostgreSQL with its defaults; interleaved). redislock has no wake-up, only a retry strategy: `LinearBackoff` is its best one for a handoff, `ExponentialBackoff` doubles its wait between tries:\n\n| handoff | how it waits | n | p50 ms | p90 ms | p99 ms | max ms |\n|---|---|--:|--:|--:|--:|--:|\n")
		for _, l := range r.Redis.Handoff {
			w("| %s | %s | %d | %.2f | %.2f | %.2f | %.2f |\n", l.Name, l.Note, l.N, l.P50ms, l.P90ms, l.P99ms, l.MaxMs)
		}
	}
}
