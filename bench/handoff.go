package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"cirello.io/pglock"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/ashlock/ashlock/dialect/postgres"
	"github.com/ashlock/ashlock/sqllock"
)

// Latency is a distribution of handoff or takeover times.
type Latency struct {
	Section string    `json:"section"`
	Name    string    `json:"name"`
	Note    string    `json:"note,omitempty"`
	N       int       `json:"n"`
	P50ms   float64   `json:"p50_ms"`
	P90ms   float64   `json:"p90_ms"`
	P99ms   float64   `json:"p99_ms"`
	MaxMs   float64   `json:"max_ms"`
	Samples []float64 `json:"samples_ms"`
	Errors  int       `json:"errors,omitempty"`
}

func newLatency(section, name, note string, ds []time.Duration, errs int) Latency {
	l := Latency{Section: section, Name: name, Note: note, N: len(ds), Errors: errs,
		P50ms: ms(durQuantile(ds, 0.5)), P90ms: ms(durQuantile(ds, 0.9)), P99ms: ms(durQuantile(ds, 0.99)), MaxMs: ms(durQuantile(ds, 1))}
	for _, d := range ds {
		l.Samples = append(l.Samples, ms(d))
	}
	return l
}

// handoffSide is one "process": its own pool, backend and client.
type handoffSide struct {
	backend *postgres.Backend
	client  *sqllock.Client
	close   func()
}

func (e *pgEnv) side(ctx context.Context, name string, notify bool) (*handoffSide, error) {
	pool, err := e.newPool(ctx, 4, nil)
	if err != nil {
		return nil, err
	}
	b, err := postgres.New(pool, postgres.Options{Schema: benchSchema, DisableNotify: !notify})
	if err != nil {
		return nil, err
	}
	c, err := sqllock.New(b, sqllock.Options{Owner: name})
	if err != nil {
		return nil, err
	}
	return &handoffSide{backend: b, client: c, close: func() {
		c.Close(context.Background())
		b.Close()
		pool.Close()
	}}, nil
}

// handoffHold is how long the holder keeps the lock after the waiter has
// started waiting: uniform in [20 ms, 120 ms).
func handoffHold(rng *rand.Rand) time.Duration {
	return 20*time.Millisecond + time.Duration(rng.Int64N(int64(100*time.Millisecond)))
}

// oneHandoff: the holder holds key, a waiter calls Acquire, the holder
// releases after a random hold; the sample is from just before Release is
// called to Acquire's return in the waiter.
func oneHandoff(ctx context.Context, holder, waiter *sqllock.Client, key string, hold time.Duration) (time.Duration, error) {
	hg, err := holder.TryAcquire(ctx, key, nil)
	if err != nil {
		return 0, fmt.Errorf("holder: %w", err)
	}
	type result struct {
		at time.Time
		g  *sqllock.Guard
		e  error
	}
	got := make(chan result, 1)
	go func() {
		g, err := waiter.Acquire(ctx, key, &sqllock.AcquireOptions{Wait: 30 * time.Second})
		got <- result{time.Now(), g, err}
	}()
	time.Sleep(hold)
	t0 := time.Now()
	if err := hg.Release(ctx); err != nil {
		return 0, fmt.Errorf("holder release: %w", err)
	}
	r := <-got
	if r.e != nil {
		return 0, fmt.Errorf("waiter: %w", r.e)
	}
	if err := r.g.Release(ctx); err != nil {
		return 0, err
	}
	return r.at.Sub(t0), nil
}

func (e *pgEnv) handoff(ctx context.Context, cfg *config) ([]Latency, error) {
	n := 60
	if cfg.quick {
		n = 20
	}
	type variant struct {
		name, note string
		one        func(ctx context.Context, key string, hold time.Duration) (time.Duration, error)
		ds         []time.Duration
		errs       int
	}
	var vs []*variant
	for _, notify := range []bool{true, false} {
		name := notifyHandoffName
		note := "LISTEN/NOTIFY wake-up"
		if !notify {
			name, note = "ashlock, DisableNotify", "polling with DefaultBackoff"
		}
		h, err := e.side(ctx, "holder", notify)
		if err != nil {
			return nil, err
		}
		defer h.close()
		w, err := e.side(ctx, "waiter", notify)
		if err != nil {
			return nil, err
		}
		defer w.close()
		vs = append(vs, &variant{name: name, note: note, one: func(ctx context.Context, key string, hold time.Duration) (time.Duration, error) {
			return oneHandoff(ctx, h.client, w.client, key, hold)
		}})
	}
	raw, err := e.newRawHandoff(ctx)
	if err != nil {
		return nil, err
	}
	defer raw.close()
	vs = append(vs, &variant{name: rawHandoffName, note: "the floor of a wake-up by notification on this machine: see below", one: raw.one})
	rng := rand.New(rand.NewPCG(1, 2))
	// One warm-up each (starts the listener), then the samples, alternating.
	for i := -1; i < n; i++ {
		for k := range vs {
			v := vs[(k+i+1)%len(vs)]
			d, err := v.one(ctx, "handoff-"+v.name, handoffHold(rng))
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			switch {
			case err != nil:
				v.errs++
				logf("handoff %s: %v", v.name, err)
			case i >= 0:
				v.ds = append(v.ds, d)
			}
		}
	}
	var out []Latency
	for _, v := range vs {
		l := newLatency("handoff", v.name, v.note, v.ds, v.errs)
		logf("handoff %-36s n=%d p50 %.2fms p90 %.2fms p99 %.2fms max %.2fms", v.name, l.N, l.P50ms, l.P90ms, l.P99ms, l.MaxMs)
		out = append(out, l)
	}
	return out, nil
}

// The names of the handoffs the report compares.
const (
	notifyHandoffName = "ashlock, notifications (default)"
	rawHandoffName    = "raw statements + LISTEN/NOTIFY"
)

// rawHandoffChannel is the raw handoff's notification channel.
const rawHandoffChannel = "bench_raw_handoff"

// rawReleaseNotifySQL is the raw release with a notification, committed
// asynchronously as ashlock's default release is.
const rawReleaseNotifySQL = `
WITH async AS MATERIALIZED (SELECT set_config('synchronous_commit', 'off', true)),
r AS (UPDATE raw_locks AS l SET held = false FROM async WHERE l.key = $1 AND l.token = $2 RETURNING l.key)
SELECT pg_notify('` + rawHandoffChannel + `', r.key) FROM r`

// rawHandoff is the handoff a hand-written lock on the raw statements
// would do, on the same machine and server as ashlock's: the holder
// releases with the raw release and a pg_notify in the same statement;
// the waiter, refused by the raw upsert, waits for a notification on a
// connection of its own that LISTENs, then sends the upsert again (a
// durable grant). No client library, no guard, no renewal: what is left
// is the two statements, the commit, the notification and the wake-ups
// between processes, which ashlock's handoff cannot go below.
type rawHandoff struct {
	holder, waiter *pgxpool.Pool
	listen         *pgx.Conn
}

func (e *pgEnv) newRawHandoff(ctx context.Context) (*rawHandoff, error) {
	r := &rawHandoff{}
	var err error
	if r.holder, err = e.newPool(ctx, 4, nil); err != nil {
		return nil, err
	}
	if r.waiter, err = e.newPool(ctx, 4, nil); err != nil {
		r.close()
		return nil, err
	}
	if r.listen, err = pgx.Connect(ctx, e.url); err != nil {
		r.close()
		return nil, err
	}
	if _, err = r.listen.Exec(ctx, "LISTEN "+rawHandoffChannel); err != nil {
		r.close()
		return nil, err
	}
	return r, nil
}

func (r *rawHandoff) close() {
	if r.listen != nil {
		r.listen.Close(context.Background())
	}
	if r.waiter != nil {
		r.waiter.Close()
	}
	if r.holder != nil {
		r.holder.Close()
	}
}

// one is oneHandoff for the raw statements.
func (r *rawHandoff) one(ctx context.Context, key string, hold time.Duration) (time.Duration, error) {
	token, err := rawAcquire(ctx, r.holder, key, "raw-holder", micros(sqllock.DefaultTTL))
	if err != nil {
		return 0, fmt.Errorf("holder: %w", err)
	}
	if token == 0 {
		return 0, fmt.Errorf("holder: %q is held", key)
	}
	type result struct {
		at    time.Time
		token int64
		e     error
	}
	got := make(chan result, 1)
	waiting := make(chan struct{})
	go func() {
		for first := true; ; first = false {
			t, err := rawAcquire(ctx, r.waiter, key, "raw-waiter", micros(sqllock.DefaultTTL))
			if err != nil || t > 0 {
				got <- result{time.Now(), t, err}
				return
			}
			if first {
				close(waiting)
			}
			// Wake on a notification, or poll every 100 ms.
			wctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
			_, err = r.listen.WaitForNotification(wctx)
			cancel()
			if err != nil && ctx.Err() != nil {
				got <- result{e: ctx.Err()}
				return
			}
		}
	}()
	select {
	case <-waiting:
	case res := <-got:
		if res.e != nil {
			return 0, fmt.Errorf("waiter: %w", res.e)
		}
		return 0, fmt.Errorf("waiter: granted token %d while the holder held %q", res.token, key)
	}
	time.Sleep(hold)
	t0 := time.Now()
	if _, err := r.holder.Exec(ctx, rawReleaseNotifySQL, key, token); err != nil {
		return 0, fmt.Errorf("holder release: %w", err)
	}
	res := <-got
	if res.e != nil {
		return 0, fmt.Errorf("waiter: %w", res.e)
	}
	// Release without a notification: nobody waits.
	if _, err := r.waiter.Exec(ctx, rawReleaseAsyncSQL, key, res.token); err != nil {
		return 0, err
	}
	return res.at.Sub(t0), nil
}

// startPglockHandoff starts the pglock handoff samples in the background
// (each spends ~20 s idle, waiting for its next poll) and returns a
// function that waits for them.
func (e *pgEnv) startPglockHandoff(ctx context.Context, cfg *config) func() (Latency, error) {
	n := 10
	if cfg.quick {
		n = 5
	}
	var (
		l   Latency
		err error
	)
	done := make(chan struct{})
	go func() {
		defer close(done)
		l, err = e.pglockHandoff(ctx, n, rand.New(rand.NewPCG(3, 4)))
	}()
	return func() (Latency, error) {
		<-done
		if err == nil {
			logf("handoff %-36s n=%d p50 %.2fms p90 %.2fms p99 %.2fms max %.2fms", l.Name, l.N, l.P50ms, l.P90ms, l.P99ms, l.MaxMs)
		}
		return l, err
	}
}

// pglockHandoff measures pglock with its defaults (20 s lease, 5 s
// heartbeat): a waiting AcquireContext polls once per lease duration. The
// samples run in parallel on distinct keys, since each takes ~20 s of
// idle waiting.
func (e *pgEnv) pglockHandoff(ctx context.Context, n int, rng *rand.Rand) (Latency, error) {
	holder, err := pglock.New(e.pglockDB, pglock.WithCustomTable("pglock_locks"))
	if err != nil {
		return Latency{}, err
	}
	waiter, err := pglock.New(e.pglockDB, pglock.WithCustomTable("pglock_locks"))
	if err != nil {
		return Latency{}, err
	}
	holds := make([]time.Duration, n)
	for i := range holds {
		holds[i] = handoffHold(rng)
	}
	var (
		mu   sync.Mutex
		ds   []time.Duration
		errs int
		wg   sync.WaitGroup
	)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d, err := func() (time.Duration, error) {
				key := fmt.Sprintf("handoff-pglock-%d", i)
				hl, err := holder.AcquireContext(ctx, key, pglock.FailIfLocked())
				if err != nil {
					return 0, err
				}
				wctx, cancel := context.WithTimeout(ctx, 60*time.Second)
				defer cancel()
				type result struct {
					at time.Time
					l  *pglock.Lock
					e  error
				}
				got := make(chan result, 1)
				go func() {
					l, err := waiter.AcquireContext(wctx, key)
					got <- result{time.Now(), l, err}
				}()
				time.Sleep(holds[i])
				t0 := time.Now()
				if err := holder.ReleaseContext(ctx, hl); err != nil {
					return 0, err
				}
				r := <-got
				if r.e != nil {
					return 0, r.e
				}
				if err := waiter.ReleaseContext(ctx, r.l); err != nil && !errors.Is(err, pglock.ErrLockAlreadyReleased) {
					return 0, err
				}
				return r.at.Sub(t0), nil
			}()
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				errs++
				logf("handoff pglock: %v", err)
				return
			}
			ds = append(ds, d)
		}()
	}
	wg.Wait()
	return newLatency("handoff", "cirello.io/pglock v1.16.1, defaults", "waiter re-polls once per 20 s lease; samples run in parallel on distinct keys, alongside the ashlock handoff and takeover samples", ds, errs), ctx.Err()
}
