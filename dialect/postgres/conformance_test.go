package postgres

import (
	"context"
	"path"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
	"github.com/ashlock/ashlock/sqllock/backendtest"
)

func TestConformance(t *testing.T) {
	t.Parallel()
	backendtest.Run(t, harness(func(t *testing.T) sqllock.Backend {
		return newBundle(t, Options{}).backend
	}))
}

// TestConformancePgBouncerSettings runs the suite as behind PgBouncer in
// transaction mode: no LISTEN/NOTIFY, and pgx without named prepared
// statements (each exec mode docs/pgbouncer.md documents for it). Only the Watch
// rule skips: batch renewal is offered, as a Client behind PgBouncer
// renews through it.
func TestConformancePgBouncerSettings(t *testing.T) {
	t.Parallel()
	for _, mode := range transactionModes {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			backendtest.Run(t, harness(func(t *testing.T) sqllock.Backend {
				bundle := newBundle(t, Options{})
				pool := newPool(t, bundle, func(cfg *pgxpool.Config) { cfg.ConnConfig.DefaultQueryExecMode = mode })
				b, err := New(pool, Options{DisableNotify: true})
				require.NoError(t, err)
				t.Cleanup(func() { b.Close() })
				// With DisableNotify, Watch never fires (clients poll), so
				// the suite does not see the Watcher.
				return pollOnly{b, b}
			}, watchRules...))
		})
	}
}

// transactionModes are the exec modes docs/pgbouncer.md documents for PgBouncer
// in transaction mode: none prepares a named statement.
var transactionModes = []pgx.QueryExecMode{pgx.QueryExecModeExec, pgx.QueryExecModeCacheDescribe, pgx.QueryExecModeSimpleProtocol}

// watchRules are the suite's rules of the Watcher (a release's, and a
// shared key's last release's), the only ones a Backend with
// DisableNotify may skip.
var watchRules = []string{"WatchSignalsRelease", "WatchSignalsLastRelease"}

// pollOnly is a Backend as a Client sees it with DisableNotify: without
// the Watcher (embedding the interface promotes its four methods only),
// with batch renewal, permits, the acquire and release of a set, and
// reaping.
type pollOnly struct {
	sqllock.Backend
	pg *Backend
}

func (p pollOnly) TryAcquirePermit(ctx context.Context, req sqllock.PermitRequest) (sqllock.Lease, error) {
	return p.pg.TryAcquirePermit(ctx, req)
}

func (p pollOnly) TryAcquireAll(ctx context.Context, req sqllock.MultiAcquireRequest) ([]sqllock.Lease, error) {
	return p.pg.TryAcquireAll(ctx, req)
}

func (p pollOnly) Reap(ctx context.Context, olderThan time.Duration, limit int) (int, error) {
	return p.pg.Reap(ctx, olderThan, limit)
}

func (p pollOnly) ReleaseAll(ctx context.Context, ls []sqllock.Lease) ([]error, error) {
	return p.pg.ReleaseAll(ctx, ls)
}

func (p pollOnly) TryRenewBatch(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
	return p.pg.TryRenewBatch(ctx, reqs)
}

// harness is the suite's Harness for the backends newBackend builds. A
// rule that skips fails, unless it is named in mayskip: a backend (or a
// wrapper) that stops offering an interface must not pass by skipping the
// rules of it.
func harness(newBackend func(t *testing.T) sqllock.Backend, mayskip ...string) backendtest.Harness {
	return backendtest.Harness{
		New: func(t *testing.T) sqllock.Backend {
			t.Cleanup(func() {
				if t.Skipped() && !slices.Contains(mayskip, path.Base(t.Name())) {
					t.Errorf("the rule skipped; here only %q may", mayskip)
				}
			})
			return newBackend(t)
		},
		Expire: func(t *testing.T, b sqllock.Backend, key string) {
			expire(t, unwrap(b), key)
		},
		SetToken: func(t *testing.T, b sqllock.Backend, key string, token int64) {
			pb := unwrap(b)
			_, err := adminPool(pb).Exec(testCtx(t), "INSERT INTO "+pb.table+` (key, token, held, deadline, owner)
				VALUES ($1, $2, false, clock_timestamp(), 'settoken')
				ON CONFLICT (key) DO UPDATE SET token = excluded.token, held = false, hold_until = NULL`, key, token)
			require.NoError(t, err)
		},
		Shared: true,
	}
}

func unwrap(b sqllock.Backend) *Backend {
	if p, ok := b.(pollOnly); ok {
		return p.pg
	}
	return b.(*Backend)
}

func FuzzPostgres(f *testing.F) { backendtest.Fuzz(f, newBundle(f, Options{}).backend) }
