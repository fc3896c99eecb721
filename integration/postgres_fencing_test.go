package integration

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/dialect/postgres"
	"github.com/ashlock/ashlock/internal/testkit/pgtest"
	"github.com/ashlock/ashlock/sqllock"
)

// TestPostgresFencedContention runs 16 clients, each with its own Client
// and Backend, competing for 3 keys for 10 s. Every holder increments a
// per-key counter with a read-modify-write inside Backend.FencedTx, and
// writes a protected row guarded by its token (WHERE fence <= token). About
// one tenure in five plays a stale holder: its lease is expired behind its
// back (as by a pause past the deadline), and once a newer holder has
// written, it tries both kinds of write with its old lease.
//
// At the end: the counters equal the fenced transactions that committed (no
// lost update, so no two fenced transactions overlapped), no stale write was
// applied (the protected rows' audit log never goes back in token order),
// every stale attempt was refused, and no token was granted twice for a key.
func TestPostgresFencedContention(t *testing.T) {
	t.Parallel()
	const (
		clients  = 16
		duration = 10 * time.Second
		ttl      = 2 * time.Second
	)
	keys := []string{"alpha", "beta", "gamma"}

	db := pgtest.New(t)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	migrateUp(ctx, t, db)
	_, err := db.Pool.Exec(ctx, `
		CREATE TABLE counter (k text PRIMARY KEY, n bigint NOT NULL);
		CREATE TABLE protected (k text PRIMARY KEY, val bigint NOT NULL, fence bigint NOT NULL);
		CREATE TABLE audit (id bigserial PRIMARY KEY, k text NOT NULL, token bigint NOT NULL);`)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, "INSERT INTO counter SELECT unnest($1::text[]), 0", keys)
	require.NoError(t, err)
	_, err = db.Pool.Exec(ctx, "INSERT INTO protected SELECT unnest($1::text[]), 0, 0", keys)
	require.NoError(t, err)
	// The protected write: applied only with a token at least the highest
	// seen, and logged (in row-lock order, so in commit order) when applied.
	const protectedWrite = `WITH w AS (
		UPDATE protected SET val = val + 1, fence = $2 WHERE k = $1 AND fence <= $2 RETURNING k
	) INSERT INTO audit (k, token) SELECT k, $2 FROM w`

	cfg, err := pgxpool.ParseConfig(db.URL)
	require.NoError(t, err)
	cfg.MaxConns = 2*clients + 4 // workers and watchdogs; listeners are taken out of the pool
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	require.NoError(t, err)
	defer pool.Close()

	var (
		fencedOK, fencedLost         atomic.Int64
		fencedUnknown                atomic.Int64
		writesApplied, staleAttempts atomic.Int64
		staleFenceRefused            atomic.Int64
		staleWriteRefused            atomic.Int64
		mu                           sync.Mutex
		granted                      = map[string][]int64{}
	)
	runCtx, stopRun := context.WithTimeout(ctx, duration)
	defer stopRun()

	worker := func(id int) error {
		be, err := postgres.New(pool, postgres.Options{})
		if err != nil {
			return err
		}
		defer be.Close()
		c, err := sqllock.New(be, sqllock.Options{Owner: fmt.Sprint("client-", id), TTL: ttl})
		if err != nil {
			return err
		}
		defer c.Close(context.Background())
		rng := rand.New(rand.NewPCG(uint64(id), 1))
		for runCtx.Err() == nil {
			key := keys[rng.IntN(len(keys))]
			g, err := c.Acquire(runCtx, key, &sqllock.AcquireOptions{Wait: sqllock.WaitForever})
			if err != nil {
				if runCtx.Err() != nil {
					return nil
				}
				return fmt.Errorf("client %d: acquire %s: %w", id, key, err)
			}
			l := g.Lease()
			mu.Lock()
			granted[key] = append(granted[key], l.Token)
			mu.Unlock()

			if rng.IntN(5) == 0 {
				if err := playStale(ctx, runCtx, db.Pool, be, l, protectedWrite, &staleAttempts, &staleFenceRefused, &staleWriteRefused); err != nil {
					return fmt.Errorf("client %d: stale %s/%d: %w", id, key, l.Token, err)
				}
				_ = g.Release(ctx) // reports the loss; nothing to undo
				continue
			}

			err = be.FencedTx(g.Context(), l, func(tx pgx.Tx) error {
				var n int64
				if err := tx.QueryRow(ctx, "SELECT n FROM counter WHERE k = $1", key).Scan(&n); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, "UPDATE counter SET n = $2 WHERE k = $1", key, n+1)
				return err
			})
			switch {
			case err == nil:
				fencedOK.Add(1)
			case errors.Is(err, sqllock.ErrIndeterminate):
				fencedUnknown.Add(1) // the run ended during the commit
			case errors.Is(err, sqllock.ErrLeaseLost) || g.Context().Err() != nil:
				fencedLost.Add(1) // lost for real (slow machine), or the run ended: refused, fine
			default:
				return fmt.Errorf("client %d: fenced tx %s/%d: %w", id, key, l.Token, err)
			}
			tag, err := pool.Exec(ctx, protectedWrite, key, l.Token)
			if err != nil {
				return fmt.Errorf("client %d: protected write: %w", id, err)
			}
			writesApplied.Add(tag.RowsAffected())
			if err := g.Release(ctx); err != nil && !errors.Is(err, sqllock.ErrLeaseLost) {
				return fmt.Errorf("client %d: release: %w", id, err)
			}
		}
		return nil
	}

	errs := make(chan error, clients)
	var wg sync.WaitGroup
	for id := range clients {
		wg.Go(func() { errs <- worker(id) })
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}

	// Counter: every committed fenced transaction counted exactly once
	// (those whose commit had an unknown outcome may or may not count).
	var total int64
	require.NoError(t, db.Pool.QueryRow(ctx, "SELECT sum(n) FROM counter").Scan(&total))
	require.GreaterOrEqual(t, total, fencedOK.Load(), "lost updates: fenced transactions overlapped")
	require.LessOrEqual(t, total, fencedOK.Load()+fencedUnknown.Load(), "more increments than fenced transactions")

	// Stale writes applied: an applied write whose token is below one
	// applied before it on the same key.
	var staleApplied, auditRows int64
	require.NoError(t, db.Pool.QueryRow(ctx, `
		SELECT count(*) FILTER (WHERE token < prev_max), count(*) FROM (
			SELECT token, max(token) OVER (PARTITION BY k ORDER BY id ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING) AS prev_max
			FROM audit) a`).Scan(&staleApplied, &auditRows))
	require.Zero(t, staleApplied, "stale writes applied")
	require.Equal(t, writesApplied.Load(), auditRows)

	// Tokens: never granted twice per key. (Grants of a key are serialized
	// by its row lock and each adds one to the row's token, so distinct
	// tokens are strictly increasing in grant order; a grant whose reply was
	// lost at the end of the run may leave a gap, so gaps are allowed.)
	for _, key := range keys {
		toks := append([]int64(nil), granted[key]...)
		sort.Slice(toks, func(i, j int) bool { return toks[i] < toks[j] })
		for i := 1; i < len(toks); i++ {
			require.Less(t, toks[i-1], toks[i], "key %s: token %d granted twice", key, toks[i])
		}
	}

	var grants int
	for _, k := range keys {
		grants += len(granted[k])
	}
	require.Positive(t, fencedOK.Load())
	require.Positive(t, staleAttempts.Load(), "no stale holder was played")
	require.Equal(t, staleAttempts.Load(), staleFenceRefused.Load(), "stale fenced transactions must all be refused")
	require.Equal(t, staleAttempts.Load(), staleWriteRefused.Load(), "stale protected writes must all be refused")
	t.Logf("%d clients x %d keys for %v: grants=%d fenced_ok=%d fenced_indeterminate=%d fenced_lost=%d counter=%d writes_applied=%d "+
		"stale_attempts=%d stale_fenced_refused=%d stale_writes_refused=%d stale_writes_applied=%d anomalies=0",
		clients, len(keys), duration, grants, fencedOK.Load(), fencedUnknown.Load(), fencedLost.Load(), total, writesApplied.Load(),
		staleAttempts.Load(), staleFenceRefused.Load(), staleWriteRefused.Load(), staleApplied)
}

// playStale makes lease l stale: it expires l's row behind the holder's back
// (as a pause past the deadline would), waits until a newer holder has
// written the protected row, and then tries a fenced transaction and a
// protected write with l. Both must be refused. If the run ends first (no
// newer holder will come), it gives up without an attempt.
func playStale(ctx, runCtx context.Context, pool *pgxpool.Pool, be *postgres.Backend, l sqllock.Lease, protectedWrite string,
	attempts, fenceRefused, writeRefused *atomic.Int64) error {
	if _, err := pool.Exec(ctx, "UPDATE sqllock_locks SET deadline = clock_timestamp() - interval '1 millisecond' WHERE key = $1 AND token = $2", l.Key, l.Token); err != nil {
		return err
	}
	// Poll (bounded) until a newer holder's write landed.
	deadline := time.Now().Add(20 * time.Second)
	for {
		var fence int64
		if err := pool.QueryRow(ctx, "SELECT fence FROM protected WHERE k = $1", l.Key).Scan(&fence); err != nil {
			return err
		}
		if fence > l.Token {
			break
		}
		if time.Now().After(deadline) {
			return errors.New("no newer holder wrote within 20s")
		}
		select {
		case <-runCtx.Done():
			return nil
		case <-time.After(5 * time.Millisecond):
		}
	}
	attempts.Add(1)
	err := be.FencedTx(ctx, l, func(pgx.Tx) error { return errors.New("fn ran under a stale lease") })
	if errors.Is(err, sqllock.ErrLeaseLost) {
		fenceRefused.Add(1)
	} else {
		return fmt.Errorf("stale fenced transaction: %v", err)
	}
	tag, err := pool.Exec(ctx, protectedWrite, l.Key, l.Token)
	if err != nil {
		return err
	}
	if tag.RowsAffected() == 0 {
		writeRefused.Add(1)
	}
	return nil
}
