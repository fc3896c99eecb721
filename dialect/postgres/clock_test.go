package postgres

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// TestDatabaseClockSkew (docs/pitfalls.md#1, ShedLock#231): the database's clock an
// hour ahead of or behind the hosts' clocks changes nothing. Deadlines are
// database time, the guard's local deadline is the host's monotonic send
// time + TTL − margin, and the two are never compared. The skew is made by
// a statement_timestamp() and a clock_timestamp() in a schema that comes
// before pg_catalog in the search_path, which the statements' unqualified
// calls find (the single-key statements read the former, the batch
// statements the latter).
func TestDatabaseClockSkew(t *testing.T) {
	t.Parallel()
	for name, offset := range map[string]string{"Ahead": "1 hour", "Behind": "-1 hour"} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			want := time.Hour
			if offset[0] == '-' {
				want = -time.Hour
			}
			bundle := newBundle(t, Options{})
			skew := bundle.db.Schema + "_skew"
			_, err := bundle.db.Pool.Exec(testCtx(t), `CREATE SCHEMA `+skew+`;
CREATE FUNCTION `+skew+`.clock_timestamp() RETURNS timestamptz LANGUAGE sql VOLATILE
AS $$ SELECT pg_catalog.clock_timestamp() + interval '`+offset+`' $$;
CREATE FUNCTION `+skew+`.statement_timestamp() RETURNS timestamptz LANGUAGE sql STABLE
AS $$ SELECT pg_catalog.statement_timestamp() + interval '`+offset+`' $$`)
			require.NoError(t, err)
			t.Cleanup(func() {
				_, err := bundle.db.Pool.Exec(testCtx(t), `DROP SCHEMA `+skew+` CASCADE`)
				require.NoError(t, err)
			})
			pool := poolWith(t, bundle, map[string]string{"search_path": bundle.db.Schema + "," + skew + ",pg_catalog"})
			b, err := New(pool, Options{})
			require.NoError(t, err)
			t.Cleanup(func() { require.NoError(t, b.Close()) })

			const ttl, margin = 3 * time.Second, 50 * time.Millisecond
			c, err := sqllock.New(b, sqllock.Options{TTL: ttl, Margin: margin})
			require.NoError(t, err)
			defer c.Close(testCtx(t))
			before := time.Now()
			g, err := c.TryAcquire(testCtx(t), "k", nil)
			require.NoError(t, err)
			after := time.Now()
			l := g.Lease()
			// The skew is in effect (the server runs on this host).
			require.WithinDuration(t, after.Add(want), l.BackendTime, 5*time.Second)
			require.Equal(t, ttl+time.Microsecond, l.Deadline.Sub(l.BackendTime))
			// The local deadline is host time only.
			require.False(t, g.LocalDeadline().Before(before.Add(ttl-margin)), "local deadline %v before send+TTL−margin", g.LocalDeadline())
			require.False(t, g.LocalDeadline().After(after.Add(ttl-margin)), "local deadline %v after send+TTL−margin", g.LocalDeadline())

			// Renewals keep it (every TTL/3), and others see it held with
			// its remaining time in database time.
			time.Sleep(ttl*2/3 + 200*time.Millisecond)
			require.NoError(t, g.Err())
			other, err := sqllock.New(b, sqllock.Options{TTL: ttl})
			require.NoError(t, err)
			defer other.Close(testCtx(t))
			_, err = other.TryAcquire(testCtx(t), "k", nil)
			var held *sqllock.HeldError
			require.True(t, errors.As(err, &held), "%v", err)
			require.Greater(t, held.Remaining, time.Duration(0))
			require.LessOrEqual(t, held.Remaining, ttl)
			require.NoError(t, g.Release(testCtx(t)))
		})
	}
}
