package postgres

import (
	"testing"

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
// statements (QueryExecModeExec, or the simple protocol).
func TestConformancePgBouncerSettings(t *testing.T) {
	t.Parallel()
	for _, mode := range []pgx.QueryExecMode{pgx.QueryExecModeExec, pgx.QueryExecModeSimpleProtocol} {
		t.Run(mode.String(), func(t *testing.T) {
			t.Parallel()
			backendtest.Run(t, harness(func(t *testing.T) sqllock.Backend {
				bundle := newBundle(t, Options{})
				pool := newPool(t, bundle, func(cfg *pgxpool.Config) { cfg.ConnConfig.DefaultQueryExecMode = mode })
				b, err := New(pool, Options{DisableNotify: true})
				require.NoError(t, err)
				t.Cleanup(func() { b.Close() })
				// With DisableNotify, Watch never fires (clients poll), so
				// the suite sees the Backend methods only.
				return pollOnly{b, b}
			}))
		})
	}
}

// pollOnly hides the Watcher of a Backend: embedding the interface
// promotes its four methods only.
type pollOnly struct {
	sqllock.Backend
	pg *Backend
}

func harness(newBackend func(t *testing.T) sqllock.Backend) backendtest.Harness {
	return backendtest.Harness{
		New: newBackend,
		Expire: func(t *testing.T, b sqllock.Backend, key string) {
			expire(t, unwrap(b), key)
		},
		SetToken: func(t *testing.T, b sqllock.Backend, key string, token int64) {
			pb := unwrap(b)
			_, err := pb.pool.Exec(testCtx(t), "INSERT INTO "+pb.table+` (key, token, held, deadline, owner)
				VALUES ($1, $2, false, clock_timestamp(), 'settoken')
				ON CONFLICT (key) DO UPDATE SET token = excluded.token, held = false`, key, token)
			require.NoError(t, err)
		},
	}
}

func unwrap(b sqllock.Backend) *Backend {
	if p, ok := b.(pollOnly); ok {
		return p.pg
	}
	return b.(*Backend)
}

func FuzzPostgres(f *testing.F) { backendtest.Fuzz(f, newBundle(f, Options{}).backend) }
