package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"go.uber.org/zap"

	"github.com/ashlock/ashlock/dialect/etcd"
	"github.com/ashlock/ashlock/internal/testkit/etcdserver"
	"github.com/ashlock/ashlock/sqllock"
)

var etcdRatios = [][2]string{{"backend", "mutex"}, {"client", "mutex"}, {"client", "backend"}}

// etcdEnv is the etcd section's server and clients.
type etcdEnv struct {
	endpoints []string
	version   string
	members   int                 // 0 with -etcd-endpoints: not known
	cluster   *etcdserver.Cluster // nil with -etcd-endpoints
	clients   []*clientv3.Client
}

// startEtcd starts an etcd of members members the way the tests do
// (package etcdserver: the machine's binary, a temp dir on disk with
// etcd's default durable settings, free loopback ports), unless endpoints
// are given.
func startEtcd(ctx context.Context, endpoints string, members int) (*etcdEnv, error) {
	e := &etcdEnv{}
	if endpoints != "" {
		e.endpoints = strings.Split(endpoints, ",")
	} else {
		if members != 1 && members != 3 {
			return nil, fmt.Errorf("-etcd-members %d: want 1 or 3", members)
		}
		begin := time.Now()
		c, err := etcdserver.Start(ctx, etcdserver.Options{Members: members})
		if err != nil {
			return nil, fmt.Errorf("start etcd (or pass -etcd-endpoints): %w", err)
		}
		if err := c.WaitReady(ctx); err != nil {
			c.Close()
			return nil, fmt.Errorf("etcd: %w", err)
		}
		e.cluster, e.endpoints, e.members = c, c.Endpoints(), members
		logf("started etcd %s in %s in %v", c.Bin(), c.Dir(), time.Since(begin).Round(time.Millisecond))
	}
	cli, err := e.client()
	if err != nil {
		e.close()
		return nil, err
	}
	st, err := cli.Status(ctx, e.endpoints[0])
	if err != nil {
		e.close()
		return nil, fmt.Errorf("etcd status: %w", err)
	}
	e.version = st.Version
	return e, nil
}

func (e *etcdEnv) client() (*clientv3.Client, error) {
	cli, err := clientv3.New(clientv3.Config{Endpoints: e.endpoints, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
	if err != nil {
		return nil, err
	}
	e.clients = append(e.clients, cli)
	return cli, nil
}

func (e *etcdEnv) close() {
	for _, c := range e.clients {
		c.Close()
	}
	if e.cluster != nil {
		e.cluster.Close()
	}
}

// etcdMatrix: TryAcquire + Release pairs of the etcd Backend and of the
// Client over it, against etcd's own concurrency.Mutex (TryLock + Unlock,
// one session per goroutine, created before the cell: its lease is
// granted once and kept alive in the background, where each ashlock lease
// has a TTL and an etcd lease of its own), random keys, one etcd client
// for all goroutines of a contender.
func (e *etcdEnv) matrix(cfg *config) (*matrix, error) {
	keys := make([]string, cfg.keys)
	for i := range keys {
		keys[i] = fmt.Sprintf("k%05d", i)
	}
	cli, err := e.client()
	if err != nil {
		return nil, err
	}
	b, err := etcd.New(cli, etcd.Options{Prefix: "bench/ashlock/"})
	if err != nil {
		return nil, err
	}
	ccli, err := e.client()
	if err != nil {
		return nil, err
	}
	cb, err := etcd.New(ccli, etcd.Options{Prefix: "bench/client/"})
	if err != nil {
		return nil, err
	}
	c, err := sqllock.New(cb, sqllock.Options{Owner: "bench"})
	if err != nil {
		return nil, err
	}
	mcli, err := e.client()
	if err != nil {
		return nil, err
	}
	sessions := map[int]*concurrency.Session{}
	mutex := contender{name: "mutex", newWorker: func(id int, rng *rand.Rand) pairFunc {
		s := sessions[id]
		if s == nil {
			s, err = concurrency.NewSession(mcli, concurrency.WithTTL(int(defaultTTL/time.Second)))
			if err != nil {
				return func(context.Context) (bool, error) { return false, err }
			}
			sessions[id] = s
		}
		return func(ctx context.Context) (bool, error) {
			m := concurrency.NewMutex(s, "bench/mutex/"+keys[rng.IntN(len(keys))])
			err := m.TryLock(ctx)
			if errors.Is(err, concurrency.ErrLocked) {
				return false, nil
			}
			if err != nil {
				return false, err
			}
			return true, m.Unlock(ctx)
		}
	}}
	return &matrix{
		section: "etcd",
		contenders: []contender{
			backendContender("backend", b, keys, defaultTTL),
			clientContender("client", c, keys),
			mutex,
		},
		conc: cfg.conc, rounds: cfg.rounds, dur: cfg.dur, latency: true, warmup: cfg.warmup(),
		probe: newEtcdProbe(e.endpoints),
	}, nil
}

// etcdProbe reads, around each cell, what a pair costs: from every
// member's /metrics, the gRPC messages it received (each unary call and
// each keep-alive on a stream being one) and its process's CPU, summed
// over the members; the raft entries committed, WAL fsyncs and key writes
// of the member with the most (each member applies every entry); and this
// process's CPU, which is the contender's alone since cells run one at a
// time. A reading of /metrics costs a member about as much CPU as a few
// requests, once before and once after each 250 ms slice, alike for every
// contender.
type etcdProbe struct {
	urls []string // the members' client URLs
	hc   *http.Client
}

func newEtcdProbe(endpoints []string) etcdProbe {
	return etcdProbe{urls: endpoints, hc: &http.Client{Timeout: 2 * time.Second}}
}

// etcdCostMetrics are the counters read from /metrics, by the cost name
// each is reported as; a name with several series (one per gRPC method)
// is their sum. etcdSummed are the costs summed over members; the others
// are the largest member's.
var etcdCostMetrics = map[string]string{
	"process_cpu_seconds_total":                  "etcd_cpu_us",
	"grpc_server_msg_received_total":             "requests",
	"etcd_server_proposals_committed_total":      "raft_entries",
	"etcd_disk_wal_fsync_duration_seconds_count": "wal_fsyncs",
	"etcd_debugging_mvcc_put_total":              "key_writes",
	"etcd_debugging_mvcc_delete_total":           "key_writes",
}

var etcdSummed = map[string]bool{"etcd_cpu_us": true, "requests": true}

func (p etcdProbe) read(ctx context.Context) counters {
	client := rusageCPU()
	cost := map[string]float64{}
	for _, url := range p.urls {
		m, ok := p.readMember(ctx, url)
		if !ok {
			return counters{} // all or none: a partial reading is no reading
		}
		for k, v := range m {
			if etcdSummed[k] {
				cost[k] += v
			} else {
				cost[k] = max(cost[k], v)
			}
		}
	}
	cost["client_cpu_us"] = float64(client.Microseconds())
	return counters{cost: cost}
}

// readMember reads one member's cost counters.
func (p etcdProbe) readMember(ctx context.Context, url string) (map[string]float64, bool) {
	series, err := etcdserver.Metrics(ctx, p.hc, url)
	if err != nil {
		return nil, false
	}
	cost := map[string]float64{}
	seen := map[string]bool{}
	for name, v := range series {
		metric := etcdserver.MetricName(name)
		as, ok := etcdCostMetrics[metric]
		if !ok {
			continue
		}
		if as == "etcd_cpu_us" {
			v *= 1e6
		}
		cost[as] += v
		seen[metric] = true
	}
	if len(seen) != len(etcdCostMetrics) {
		return nil, false
	}
	return cost, true
}

// handoff: as the PostgreSQL handoff (a holder releases after 20–120 ms
// while a waiter waits in Acquire; from just before Release to Acquire's
// return), for the etcd Backend (woken by its etcd watch) and for
// concurrency.Mutex (Lock waits on the holder key's deletion).
func (e *etcdEnv) handoff(ctx context.Context, cfg *config) ([]Latency, error) {
	n := 60
	if cfg.quick {
		n = 20
	}
	rng := rand.New(rand.NewPCG(11, 13))
	var sides [2]*sqllock.Client
	for i := range sides {
		cli, err := e.client()
		if err != nil {
			return nil, err
		}
		b, err := etcd.New(cli, etcd.Options{Prefix: "bench/handoff/"})
		if err != nil {
			return nil, err
		}
		if sides[i], err = sqllock.New(b, sqllock.Options{Owner: fmt.Sprintf("side%d", i)}); err != nil {
			return nil, err
		}
		defer sides[i].Close(context.Background())
	}
	var ours, theirs []time.Duration
	errs := [2]int{}
	var mcli [2]*clientv3.Client
	var sess [2]*concurrency.Session
	for i := range mcli {
		var err error
		if mcli[i], err = e.client(); err != nil {
			return nil, err
		}
		if sess[i], err = concurrency.NewSession(mcli[i], concurrency.WithTTL(int(defaultTTL/time.Second))); err != nil {
			return nil, err
		}
		defer sess[i].Close()
	}
	for i := range n {
		key := fmt.Sprintf("h%d", i)
		d, err := oneHandoff(ctx, sides[0], sides[1], key, handoffHold(rng))
		if err != nil {
			errs[0]++
		} else {
			ours = append(ours, d)
		}
		d, err = mutexHandoff(ctx, sess[0], sess[1], "bench/mutex-handoff/"+key, handoffHold(rng))
		if err != nil {
			errs[1]++
		} else {
			theirs = append(theirs, d)
		}
	}
	logf("etcd handoff: ashlock p50 %v p99 %v; mutex p50 %v p99 %v", durQuantile(ours, 0.5), durQuantile(ours, 0.99), durQuantile(theirs, 0.5), durQuantile(theirs, 0.99))
	return []Latency{
		newLatency("etcd", "ashlock etcd Backend + Client, etcd watch", "", ours, errs[0]),
		newLatency("etcd", "etcd concurrency.Mutex", "", theirs, errs[1]),
	}, nil
}

func mutexHandoff(ctx context.Context, holder, waiter *concurrency.Session, key string, hold time.Duration) (time.Duration, error) {
	hm := concurrency.NewMutex(holder, key)
	if err := hm.Lock(ctx); err != nil {
		return 0, err
	}
	type result struct {
		at time.Time
		m  *concurrency.Mutex
		e  error
	}
	got := make(chan result, 1)
	go func() {
		wm := concurrency.NewMutex(waiter, key)
		wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		err := wm.Lock(wctx)
		got <- result{time.Now(), wm, err}
	}()
	time.Sleep(hold)
	t0 := time.Now()
	if err := hm.Unlock(ctx); err != nil {
		return 0, err
	}
	r := <-got
	if r.e != nil {
		return 0, r.e
	}
	if err := r.m.Unlock(ctx); err != nil {
		return 0, err
	}
	return r.at.Sub(t0), nil
}
