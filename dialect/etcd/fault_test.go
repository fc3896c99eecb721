package etcd

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/dialect/etcd/internal/etcdtest"
	"github.com/ashlock/ashlock/internal/testkit/etcdserver"
	"github.com/ashlock/ashlock/sqllock"
)

// resource is the fenced counter the storm increments, kept in the same
// etcd: every write goes through Backend.Fenced and also compares the
// resource's revision (no lost update), and carries the writer's token
// and a unique id so that the checker can tell which writes were applied.
type resource struct {
	Fence int64  `json:"fence"`
	Count int64  `json:"count"`
	ID    string `json:"id"`
}

// faultCounts are the storm's outcomes, by kind.
type faultCounts struct {
	grants, acquireErrs, releases, releaseErrs       atomic.Int64
	writesOK, writesLost, writesUnknown, writesOther atomic.Int64
	staleAttempted, staleRejected, staleUnknown      atomic.Int64
	guardsEnded, guardsLost, guardsLate              atomic.Int64
}

// TestFaults runs a storm of clients with a fenced counter against a
// 3-member cluster while it kills the leader with SIGKILL, stops a
// follower, and restarts the whole cluster; then checks etcd's own
// history: tokens strictly increasing (exactly +1) per key, never two
// holders at once, the counter exact with no lost update, stale writes
// applied 0, every guard ended by its local deadline unless renewed; and
// reports the time to the next grant after the leader's death and after
// the restart. SQLLOCK_LONG=1 runs each phase longer.
func TestFaults(t *testing.T) {
	t.Parallel()
	phase := 4 * time.Second
	if os.Getenv("SQLLOCK_LONG") == "1" {
		phase = 20 * time.Second
	}
	ctx := testCtx(t)
	cluster := startCluster(t, etcdserver.Options{Members: 3})
	const (
		workers = 6
		keys    = 2
		ttl     = 2 * time.Second
		prefix  = "faults/"
		// guardSlack is how late an observer may see a guard's context
		// end: scheduling on a loaded 2-core machine running 3 members.
		guardSlack = 500 * time.Millisecond
	)
	var (
		counts    faultCounts
		lastGrant atomic.Int64 // unix nanos of the latest grant
		mu        sync.Mutex
		applied   = map[string]bool{} // write id -> known applied (true) or rejected (false)
		unknown   = map[string]bool{}
	)
	record := func(id string, ok bool) {
		mu.Lock()
		defer mu.Unlock()
		applied[id] = ok
	}
	stormCtx, stopStorm := context.WithCancel(ctx)
	var wg, guards sync.WaitGroup
	var b *Backend
	for w := range workers {
		if w%2 == 0 {
			// Two clients share each Backend (and its etcd client), as
			// the goroutines of one process would.
			cli, err := etcdtest.NewClient(cluster.Endpoints())
			require.NoError(t, err)
			t.Cleanup(func() { cli.Close() })
			b, err = New(cli, Options{Prefix: prefix})
			require.NoError(t, err)
		}
		b := b
		c, err := sqllock.New(b, sqllock.Options{Owner: fmt.Sprintf("w%d", w), TTL: ttl})
		require.NoError(t, err)
		wg.Go(func() {
			defer c.Close(context.Background())
			for n := 0; stormCtx.Err() == nil; n++ {
				key := fmt.Sprintf("k%d", (w+n)%keys)
				g, err := c.Acquire(stormCtx, key, &sqllock.AcquireOptions{Wait: 3 * time.Second})
				if err != nil {
					counts.acquireErrs.Add(1)
					continue
				}
				counts.grants.Add(1)
				lastGrant.Store(time.Now().UnixNano())
				lease := sqllock.Lease{Key: g.Key(), Token: g.Token()}
				// Every guard ends by its local deadline unless renewed (G3):
				// its context is done no later than the last local deadline,
				// plus the time this goroutine takes to see it.
				guards.Go(func() {
					<-g.Done()
					if late := time.Since(g.LocalDeadline()); late > guardSlack {
						counts.guardsLate.Add(1)
						t.Errorf("guard %s/%d ended %v after its local deadline", g.Key(), g.Token(), late)
					}
				})
				for i := range 3 {
					if g.Context().Err() != nil {
						break
					}
					id := fmt.Sprintf("w%d-%d-%d", w, n, i)
					switch err := increment(g.Context(), b, prefix, lease, id); {
					case err == nil:
						counts.writesOK.Add(1)
						record(id, true)
					case errors.Is(err, sqllock.ErrLeaseLost):
						counts.writesLost.Add(1)
						record(id, false)
					case errors.Is(err, sqllock.ErrIndeterminate):
						counts.writesUnknown.Add(1)
						mu.Lock()
						unknown[id] = true
						mu.Unlock()
					default:
						counts.writesOther.Add(1)
					}
				}
				relErr := g.Release(context.Background())
				counts.guardsEnded.Add(1)
				var le *sqllock.LostError
				switch {
				case errors.As(relErr, &le) || errors.As(context.Cause(g.Context()), &le):
					counts.guardsLost.Add(1)
				case relErr != nil:
					counts.releaseErrs.Add(1)
					// The release failed (a fault): the lease may hold its
					// key until its TTL, so a write under it now is no
					// stale write, and the fence rightly lets it through.
					continue
				default:
					counts.releases.Add(1)
				}
				// A zombie: one more write with the ended lease's token. The
				// fence must refuse it.
				id := fmt.Sprintf("w%d-%d-stale", w, n)
				counts.staleAttempted.Add(1)
				switch err := increment(ctx, b, prefix, lease, id); {
				case errors.Is(err, sqllock.ErrLeaseLost):
					counts.staleRejected.Add(1)
					record(id, false)
				case err == nil:
					record(id, true) // counted as applied by the checker
				default:
					counts.staleUnknown.Add(1)
					mu.Lock()
					unknown[id] = true
					mu.Unlock()
				}
			}
		})
	}
	faults := map[string]int{}
	nextGrant := func(after time.Time, within time.Duration) time.Duration {
		t.Helper()
		deadline := time.Now().Add(within)
		for time.Now().Before(deadline) {
			if g := time.Unix(0, lastGrant.Load()); g.After(after) {
				return g.Sub(after)
			}
			time.Sleep(10 * time.Millisecond)
		}
		t.Errorf("no grant within %v of the fault", within)
		return -1
	}
	time.Sleep(phase)
	leader, err := cluster.Leader(ctx)
	require.NoError(t, err)
	killed := time.Now()
	require.NoError(t, cluster.Kill(leader))
	faults["kill_leader"]++
	afterLeader := nextGrant(killed, 20*time.Second)
	time.Sleep(phase)
	require.NoError(t, cluster.Start(leader))
	require.NoError(t, cluster.WaitReady(ctx))

	leader, err = cluster.Leader(ctx)
	require.NoError(t, err)
	follower := (leader + 1) % 3
	require.NoError(t, cluster.Stop(follower))
	faults["stop_follower"]++
	time.Sleep(phase)
	require.NoError(t, cluster.Start(follower))
	require.NoError(t, cluster.WaitReady(ctx))

	for i := range cluster.Members {
		require.NoError(t, cluster.Kill(i))
	}
	restarted := time.Now()
	for i := range cluster.Members {
		require.NoError(t, cluster.Start(i))
	}
	faults["restart_cluster"]++
	afterRestart := nextGrant(restarted, 30*time.Second)
	require.NoError(t, cluster.WaitReady(ctx))
	time.Sleep(phase)
	stopStorm()
	wg.Wait()
	guards.Wait()

	// The checker reads etcd's own history of every key under the prefix.
	cli, err := etcdtest.NewClient(cluster.Endpoints())
	require.NoError(t, err)
	defer cli.Close()
	hist := history(t, cli, prefix)
	anomalies := 0
	fail := func(format string, args ...any) {
		anomalies++
		t.Errorf(format, args...)
	}
	b, err = New(cli, Options{Prefix: prefix})
	require.NoError(t, err)
	staleApplied, counted := 0, int64(0)
	for k := range keys {
		key := fmt.Sprintf("k%d", k)
		// Tokens: the token record's writes are exactly +1 each.
		var last int64
		for _, ev := range hist[b.tokenKey(key)] {
			var rec tokenRecord
			require.NoError(t, json.Unmarshal(ev.Kv.Value, &rec))
			if rec.Token != last+1 {
				fail("%s: token %d after %d (rev %d)", key, rec.Token, last, ev.Kv.ModRevision)
			}
			last = rec.Token
		}
		// Holders: a new token is put only after the previous holder was
		// deleted (released or expired); a repeat of the same token (a
		// settled acquire moving to a fresh etcd lease) is no new holder.
		holder := ""
		for _, ev := range hist[b.holderKey(key)] {
			switch {
			case ev.Type == mvccpb.DELETE:
				holder = ""
			case holder != "" && string(ev.Kv.Value) != holder:
				fail("%s: token %s granted while %s held (rev %d)", key, ev.Kv.Value, holder, ev.Kv.ModRevision)
				holder = string(ev.Kv.Value)
			default:
				holder = string(ev.Kv.Value)
			}
		}
		// The counter: +1 per write, fences never going back.
		var prev resource
		for _, ev := range hist[prefix+"res/"+key] {
			var r resource
			require.NoError(t, json.Unmarshal(ev.Kv.Value, &r))
			if r.Count != prev.Count+1 {
				fail("%s: counter %d after %d: a lost update", key, r.Count, prev.Count)
			}
			if r.Fence < prev.Fence {
				staleApplied++
				fail("%s: write %s with token %d applied after token %d", key, r.ID, r.Fence, prev.Fence)
			}
			mu.Lock()
			ok, known := applied[r.ID]
			isUnknown := unknown[r.ID]
			mu.Unlock()
			switch {
			case known && !ok:
				fail("%s: write %s was refused (lease lost) yet applied", key, r.ID)
				if strings.HasSuffix(r.ID, "-stale") {
					staleApplied++
				}
			case strings.HasSuffix(r.ID, "-stale"):
				staleApplied++
				fail("%s: stale write %s applied", key, r.ID)
			case !known && !isUnknown:
				fail("%s: write %s applied but never attempted", key, r.ID)
			}
			delete(applied, r.ID)
			prev = r
			counted++
		}
	}
	mu.Lock()
	for id, ok := range applied {
		if ok {
			fail("write %s reported applied but not in etcd's history", id)
		}
	}
	mu.Unlock()
	if n := counts.guardsLate.Load(); n > 0 {
		anomalies += int(n)
	}
	if counts.grants.Load() == 0 || counts.writesOK.Load() == 0 {
		fail("the storm made no progress")
	}
	for _, kind := range []string{"kill_leader", "stop_follower", "restart_cluster"} {
		if faults[kind] == 0 {
			fail("fault %s injected 0 times", kind)
		}
	}
	t.Logf("etcd faults: grants=%d acquire_errors=%d releases=%d release_errors=%d guards ended=%d lost=%d late=%d "+
		"writes ok=%d lost=%d indeterminate=%d other=%d counter=%d | faults kill_leader=%d stop_follower=%d restart_cluster=%d | "+
		"stale writes attempted=%d rejected=%d indeterminate=%d applied=%d | next grant after leader kill=%v after cluster restart=%v | anomalies=%d",
		counts.grants.Load(), counts.acquireErrs.Load(), counts.releases.Load(), counts.releaseErrs.Load(), counts.guardsEnded.Load(), counts.guardsLost.Load(), counts.guardsLate.Load(),
		counts.writesOK.Load(), counts.writesLost.Load(), counts.writesUnknown.Load(), counts.writesOther.Load(), counted,
		faults["kill_leader"], faults["stop_follower"], faults["restart_cluster"],
		counts.staleAttempted.Load(), counts.staleRejected.Load(), counts.staleUnknown.Load(), staleApplied,
		afterLeader.Round(time.Millisecond), afterRestart.Round(time.Millisecond), anomalies)
}

// increment adds one to key's counter under lease: it reads the counter,
// then writes it in Backend.Fenced with a compare on the counter's
// revision, retrying (a bounded number of times) only when that compare
// failed, which under a held lease means a stale holder's write was
// refused in between... or a bug: the checker finds out.
func increment(ctx context.Context, b *Backend, prefix string, lease sqllock.Lease, id string) error {
	key := prefix + "res/" + lease.Key
	ctx, cancel := context.WithTimeout(ctx, 3*time.Second)
	defer cancel()
	get, err := b.cli.Get(ctx, key)
	if err != nil {
		return err
	}
	var r resource
	var rev int64
	if len(get.Kvs) > 0 {
		if err := json.Unmarshal(get.Kvs[0].Value, &r); err != nil {
			return err
		}
		rev = get.Kvs[0].ModRevision
	}
	if r.Fence > lease.Token {
		// The resource's own rule: never a write below the highest token.
		return &sqllock.LostError{Key: lease.Key, Token: lease.Token, Reason: sqllock.LostTaken, Current: r.Fence}
	}
	next, err := json.Marshal(resource{Fence: lease.Token, Count: r.Count + 1, ID: id})
	if err != nil {
		return err
	}
	resp, err := b.Fenced(ctx, lease, clientv3.OpTxn(
		[]clientv3.Cmp{clientv3.Compare(clientv3.ModRevision(key), "=", rev)},
		[]clientv3.Op{clientv3.OpPut(key, string(next))}, nil))
	if err != nil {
		return err
	}
	if !resp.Responses[0].GetResponseTxn().Succeeded {
		return errors.New("the counter changed under a held lease: " + strconv.Quote(id))
	}
	return nil
}

// history returns every event of every key under prefix, from etcd's
// first revision to now, by key.
func history(t *testing.T, cli *clientv3.Client, prefix string) map[string][]*clientv3.Event {
	t.Helper()
	ctx := testCtx(t)
	now, err := cli.Get(ctx, prefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	require.NoError(t, err)
	end := now.Header.Revision
	wctx, cancel := context.WithCancel(ctx)
	defer cancel()
	out := map[string][]*clientv3.Event{}
	for resp := range cli.Watch(wctx, prefix, clientv3.WithPrefix(), clientv3.WithRev(1)) {
		require.NoError(t, resp.Err())
		for _, ev := range resp.Events {
			out[string(ev.Kv.Key)] = append(out[string(ev.Kv.Key)], ev)
		}
		if resp.Header.Revision >= end && (len(resp.Events) == 0 || resp.Events[len(resp.Events)-1].Kv.ModRevision >= end) {
			break
		}
	}
	return out
}
