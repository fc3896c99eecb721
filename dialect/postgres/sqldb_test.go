package postgres

import (
	"database/sql"
	"fmt"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	_ "github.com/lib/pq" // registers "postgres"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
	"github.com/ashlock/ashlock/sqllock/backendtest"
)

// sqlDriver opens a *sql.DB on a server (host, port) with a test schema's
// credentials and search_path, through one database/sql driver.
type sqlDriver struct {
	name string
	open func(cfg *pgconn.Config, host string, port uint16, schema string) (*sql.DB, error)
}

// sqlDrivers are the database/sql drivers NewDB is tested on: pgx's
// stdlib driver and lib/pq scan bytea and timestamptz, and surface a
// cancelled query, each their own way.
var sqlDrivers = []sqlDriver{
	{"pgx", func(cfg *pgconn.Config, host string, port uint16, schema string) (*sql.DB, error) {
		cc, err := pgxpool.ParseConfig("")
		if err != nil {
			return nil, err
		}
		c := cc.ConnConfig
		c.Host, c.Port, c.User, c.Password, c.Database = host, port, cfg.User, cfg.Password, cfg.Database
		c.TLSConfig, c.Fallbacks = nil, nil
		c.RuntimeParams["search_path"] = schema
		return stdlib.OpenDB(*c), nil
	}},
	{"pq", func(cfg *pgconn.Config, host string, port uint16, schema string) (*sql.DB, error) {
		dsn := fmt.Sprintf("host=%s port=%d user=%s dbname=%s sslmode=disable search_path=%s", host, port, cfg.User, cfg.Database, schema)
		if cfg.Password != "" {
			dsn += " password=" + cfg.Password
		}
		return sql.Open("postgres", dsn)
	}},
}

// adminPools are the pgx pools of the DB Backends' schemas, for the
// tests' own statements (expire, SetToken): a Backend from NewDB has none.
var adminPools sync.Map // *Backend → *pgxpool.Pool

// adminPool is b's pool, or the pool of the schema of b from NewDB.
func adminPool(b *Backend) *pgxpool.Pool {
	if b.pool != nil {
		return b.pool
	}
	p, _ := adminPools.Load(b)
	return p.(*pgxpool.Pool)
}

// openDB opens a *sql.DB through d on bundle's schema, at addr (the
// server's when ""), closed in t.Cleanup after the Backends.
func openDB(t testing.TB, bundle *testBundle, d sqlDriver, addr string) *sql.DB {
	t.Helper()
	cfg, err := pgconn.ParseConfig(bundle.db.URL)
	require.NoError(t, err)
	host, port := cfg.Host, cfg.Port
	if addr != "" {
		h, p, err := net.SplitHostPort(addr)
		require.NoError(t, err)
		n, err := strconv.Atoi(p)
		require.NoError(t, err)
		host, port = h, uint16(n)
	}
	db, err := d.open(cfg, host, port, bundle.db.Schema)
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, db.Close()) })
	return db
}

// newDBBackend is a Backend from NewDB on db, on bundle's schema, closed in
// t.Cleanup before db.
func newDBBackend(t testing.TB, bundle *testBundle, db *sql.DB, opts Options) *Backend {
	t.Helper()
	b, err := NewDB(db, opts)
	require.NoError(t, err)
	adminPools.Store(b, bundle.db.Pool)
	t.Cleanup(func() {
		require.NoError(t, b.Close())
		adminPools.Delete(b)
	})
	return b
}

// dbBundle is a fresh schema and a Backend from NewDB on it through d.
func dbBundle(t testing.TB, d sqlDriver, opts Options) (*testBundle, *Backend) {
	t.Helper()
	bundle := newBundle(t, opts)
	return bundle, newDBBackend(t, bundle, openDB(t, bundle, d, ""), opts)
}

// asClient is b as a Client sees it: without the Watcher when b does not
// listen (lib/pq), so that waiters poll.
func asClient(b *Backend) sqllock.Backend {
	if !b.listen {
		return pollOnly{b, b}
	}
	return b
}

func TestDBConformance(t *testing.T) {
	t.Parallel()
	for _, d := range sqlDrivers {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			var mayskip []string
			if d.name != "pgx" {
				mayskip = append(mayskip, watchRule) // waiters poll
			}
			backendtest.Run(t, harness(func(t *testing.T) sqllock.Backend {
				_, b := dbBundle(t, d, Options{})
				return asClient(b)
			}, mayskip...))
		})
	}
}

// Under pgx's stdlib driver the Backend listens on a connection of the
// *sql.DB; under lib/pq it does not (waiters poll), said in the doc.
func TestDBListens(t *testing.T) {
	t.Parallel()
	for _, d := range sqlDrivers {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			_, b := dbBundle(t, d, Options{})
			require.Equal(t, d.name == "pgx", b.listen)
		})
	}
}

// NewDB never closes the application's *sql.DB, and refuses bad input
// before any I/O.
func TestNewDB(t *testing.T) {
	t.Parallel()
	_, err := NewDB(nil, Options{})
	require.ErrorContains(t, err, "nil *sql.DB")
	for _, d := range sqlDrivers {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			bundle := newBundle(t, Options{})
			db := openDB(t, bundle, d, "")
			_, err := NewDB(db, Options{Table: "bad-name"})
			require.Error(t, err)
			b, err := NewDB(db, Options{})
			require.NoError(t, err)
			acquireOK(t, b, "k", "o", time.Minute)
			w, stop := b.Watch("k")
			_ = w
			stop()
			require.NoError(t, b.Close())
			require.NoError(t, db.PingContext(testCtx(t)), "Close closed the application's *sql.DB")
		})
	}
}
