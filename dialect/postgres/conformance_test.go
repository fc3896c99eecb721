package postgres

import (
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
	"github.com/ashlock/ashlock/sqllock/backendtest"
)

func TestConformance(t *testing.T) {
	t.Parallel()
	backendtest.Run(t, backendtest.Harness{
		New: func(t *testing.T) sqllock.Backend {
			return newBundle(t, Options{}).backend
		},
		Expire: func(t *testing.T, b sqllock.Backend, key string) {
			pb := b.(*Backend)
			tag, err := pb.pool.Exec(testCtx(t),
				"UPDATE "+pb.table+" SET deadline = clock_timestamp() - interval '1 millisecond' WHERE key = $1", key)
			require.NoError(t, err)
			require.EqualValues(t, 1, tag.RowsAffected(), "Expire(%q): no such key", key)
		},
		SetToken: func(t *testing.T, b sqllock.Backend, key string, token int64) {
			pb := b.(*Backend)
			_, err := pb.pool.Exec(testCtx(t), "INSERT INTO "+pb.table+` (key, token, held, deadline, owner)
				VALUES ($1, $2, false, clock_timestamp(), 'settoken')
				ON CONFLICT (key) DO UPDATE SET token = excluded.token, held = false`, key, token)
			require.NoError(t, err)
		},
	})
}
