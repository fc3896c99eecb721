package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

const defaultTTL = 30 * time.Second

// mutexMap is the floor for an in-process lock table: a map behind one
// mutex, with tokens and deadlines like the memory backend's.
type mutexMap struct {
	mu sync.Mutex
	m  map[string]mapEntry
}

type mapEntry struct {
	token    int64
	held     bool
	deadline time.Time
}

func (m *mutexMap) acquire(key string, ttl time.Duration) (int64, bool) {
	now := time.Now()
	m.mu.Lock()
	defer m.mu.Unlock()
	e := m.m[key]
	if e.held && now.Before(e.deadline) {
		return 0, false
	}
	e.token++
	e.held, e.deadline = true, now.Add(ttl)
	m.m[key] = e
	return e.token, true
}

func (m *mutexMap) release(key string, token int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if e := m.m[key]; e.token == token && e.held {
		e.held = false
		m.m[key] = e
	}
}

func memoryMatrix(cfg *config) *matrix {
	keys := make([]string, cfg.keys)
	for i := range keys {
		keys[i] = fmt.Sprintf("k%05d", i)
	}
	mm := &mutexMap{m: make(map[string]mapEntry, len(keys))}
	mb := memory.New()
	for _, k := range keys {
		t, _ := mm.acquire(k, defaultTTL)
		mm.release(k, t)
		l, err := mb.TryAcquire(context.Background(), sqllock.AcquireRequest{Key: k, TTL: defaultTTL, Owner: "fill"})
		if err == nil {
			_ = mb.Release(context.Background(), l)
		}
	}
	// The whole client on the same backend: TryAcquire (a Guard on the
	// renewal scheduler) + Release.
	mc, err := sqllock.New(mb, sqllock.Options{Owner: "bench", TTL: defaultTTL})
	if err != nil {
		panic(err)
	}
	return &matrix{
		section: "memory",
		contenders: []contender{
			backendContender("ashlock-memory", mb, keys, defaultTTL),
			clientContender("ashlock-memory-client", mc, keys),
			{name: "mutex-map", newWorker: func(id int, rng *rand.Rand) pairFunc {
				return func(ctx context.Context) (bool, error) {
					k := keys[rng.IntN(len(keys))]
					t, ok := mm.acquire(k, defaultTTL)
					if !ok {
						return false, nil
					}
					mm.release(k, t)
					return true, nil
				}
			}},
		},
		conc: []int{1, 2}, rounds: cfg.rounds, dur: cfg.dur / 2, allocs: true, warmup: cfg.warmup(),
	}
}
