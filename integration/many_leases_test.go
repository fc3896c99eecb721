package integration

import (
	"context"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/dialect/postgres"
	"github.com/ashlock/ashlock/dialect/sqlite"
	"github.com/ashlock/ashlock/internal/testkit/pgtest"
	"github.com/ashlock/ashlock/sqllock"
)

// Issue 14: one client holds 10,000 leases with a 3 s TTL on a real
// database, renewed by the client's scheduler in batches. The checker reads
// the whole table through the backend's List again and again while they are
// held: a guard that was live both before and after a read must find its
// lease held and unexpired by the database's clock, with its token (no
// database deadline ever passed while its guard was live); and at the end
// no lease was lost.

// countingRenewer counts the renewal calls that reach the backend and the
// leases they carry, in either form.
type countingRenewer struct {
	sqllock.Backend
	br                           sqllock.BatchRenewer
	batches, batched, singleCall atomic.Int64
}

func (c *countingRenewer) TryRenewBatch(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
	c.batches.Add(1)
	c.batched.Add(int64(len(reqs)))
	return c.br.TryRenewBatch(ctx, reqs)
}

func (c *countingRenewer) TryRenew(ctx context.Context, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
	c.singleCall.Add(1)
	return c.Backend.TryRenew(ctx, l, ttl)
}

func TestManyLeasesHeldPostgres(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx, cancel := context.WithTimeout(t.Context(), 30*time.Second)
	defer cancel()
	migrateUp(ctx, t, db)
	be, err := postgres.New(db.Pool, postgres.Options{})
	require.NoError(t, err)
	holdMany(t, "postgres", be, 32)
}

func TestManyLeasesHeldSQLite(t *testing.T) {
	t.Parallel()
	be, err := sqlite.Open(filepath.Join(t.TempDir(), "locks.db"), sqlite.Options{Synchronous: sqlite.SynchronousFull})
	require.NoError(t, err)
	t.Cleanup(func() { _ = be.Close() })
	// SQLite has one writer at a time: the acquires queue with the
	// renewals for it, so fewer of them at once.
	holdMany(t, "sqlite", be, 4)
}

func holdMany(t *testing.T, name string, be sqllock.Backend, acquirers int) {
	const leases = 10000
	ttl := 3 * time.Second
	if raceEnabled {
		// The race detector slows the client's side of each renewal
		// (and SQLite's statement per lease) about tenfold: 10,000
		// renewals a second no longer fit two cores. The same leases
		// with a 30 s TTL renew ten times less often.
		ttl = 30 * time.Second
	}
	hold := 10 * time.Second
	if os.Getenv("SQLLOCK_LONG") == "1" {
		hold = 60 * time.Second
	}
	br, ok := be.(sqllock.BatchRenewer)
	require.True(t, ok, "%s renews in batches", name)
	cb := &countingRenewer{Backend: be, br: br}
	opts := sqllock.Options{Owner: "many", TTL: ttl}
	if raceEnabled {
		// Under the race detector a SQLite batch of 1,000 renewals holds
		// the one writer for seconds, and the releases queue behind it.
		opts.ReleaseTimeout = 30 * time.Second
	}
	c, err := sqllock.New(cb, opts)
	require.NoError(t, err)
	ctx := t.Context()
	defer c.Close(context.Background())

	start := time.Now()
	guards := make([]*sqllock.Guard, leases)
	var next atomic.Int64
	var wg sync.WaitGroup
	for range acquirers {
		wg.Go(func() {
			for i := int(next.Add(1)) - 1; i < leases; i = int(next.Add(1)) - 1 {
				g, err := c.TryAcquire(ctx, fmt.Sprintf("many-%05d", i), nil)
				if err != nil {
					t.Errorf("acquire %d: %v", i, err)
					return
				}
				guards[i] = g
			}
		})
	}
	wg.Wait()
	require.False(t, t.Failed())
	acquired := time.Since(start)

	// The checker, until the hold ends.
	live := func() []bool {
		out := make([]bool, leases)
		for i, g := range guards {
			out[i] = g.Err() == nil
		}
		return out
	}
	samples, checked, violations := 0, 0, 0
	var first string
	b0, n0, s0 := cb.batches.Load(), cb.batched.Load(), cb.singleCall.Load()
	w0 := time.Now()
	// At least the hold, and at least 5 samples: under load one List of
	// 10,000 keys can take seconds, and fewer samples would check less.
	for time.Since(w0) < hold || samples < 5 {
		before := live()
		infos, err := be.List(ctx, "many-")
		require.NoError(t, err)
		after := live()
		byKey := make(map[string]sqllock.LockInfo, len(infos))
		for _, in := range infos {
			byKey[in.Key] = in
		}
		for i, g := range guards {
			if !before[i] || !after[i] {
				continue
			}
			checked++
			in := byKey[g.Key()]
			if !in.Held || in.Token != g.Token() {
				violations++
				if first == "" {
					first = fmt.Sprintf("%s token %d live while the database shows %+v", g.Key(), g.Token(), in)
				}
			}
		}
		samples++
		time.Sleep(200 * time.Millisecond)
	}
	window := time.Since(w0)
	batches, batched, singles := cb.batches.Load()-b0, cb.batched.Load()-n0, cb.singleCall.Load()-s0
	lost := 0
	for _, g := range guards {
		if g.Err() != nil {
			lost++
			if first == "" {
				first = fmt.Sprintf("%s lost: %v", g.Key(), g.Err())
			}
		}
	}
	relStart := time.Now()
	next.Store(0)
	for range acquirers {
		wg.Go(func() {
			for i := int(next.Add(1)) - 1; i < leases; i = int(next.Add(1)) - 1 {
				if err := guards[i].Release(ctx); err != nil && lost == 0 {
					t.Errorf("release %d: %v", i, err)
				}
			}
		})
	}
	wg.Wait()
	t.Logf("RESULT test=%s backend=%s leases=%d ttl=%v acquired_in=%v hold=%v samples=%d checks=%d db_deadline_passed_while_live=%d lost=%d "+
		"renewal_calls={batches:%d, leases_in_batches:%d, single:%d, per_s:%.1f} leases_renewed_per_s=%.0f released_in=%v",
		t.Name(), name, leases, ttl, acquired.Round(time.Millisecond), window.Round(time.Millisecond), samples, checked, violations, lost,
		batches, batched, singles, float64(batches+singles)/window.Seconds(), float64(batched+singles)/window.Seconds(),
		time.Since(relStart).Round(time.Millisecond))
	require.Zero(t, violations, "first: %s", first)
	require.Zero(t, lost, "first: %s", first)
	// Every lease is renewed about once per TTL/3; in batches, that is a
	// few calls per second, not thousands.
	require.GreaterOrEqual(t, float64(batched+singles), 0.8*leases*math.Floor(window.Seconds()/(ttl/3).Seconds()), "too few renewals")
	require.Less(t, float64(batches+singles)/window.Seconds(), 100.0, "renewals are not batched")
}
