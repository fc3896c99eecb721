package postgres

import (
	"database/sql"
	"fmt"
	"net"
	"strconv"
	"strings"
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

// flavour is one way of opening a Backend: New on a pgx pool, or NewDB
// through one of sqlDrivers. bundle returns a fresh schema and the
// Backend on it; mayskip are the conformance rules it may skip.
type flavour struct {
	name    string
	bundle  func(t testing.TB, opts Options) (*testBundle, *Backend)
	mayskip []string
}

// flavours are the Backends that tests of the statements' rules run on.
var flavours = func() []flavour {
	fs := []flavour{{name: "pgxpool", bundle: func(t testing.TB, opts Options) (*testBundle, *Backend) {
		bundle := newBundle(t, opts)
		return bundle, bundle.backend
	}}}
	for _, d := range sqlDrivers {
		f := flavour{name: "sql-" + d.name, bundle: func(t testing.TB, opts Options) (*testBundle, *Backend) {
			return dbBundle(t, d, opts)
		}}
		if d.name != "pgx" {
			f.mayskip = watchRules // waiters poll
		}
		fs = append(fs, f)
	}
	return fs
}()

// withDSNParams is d with params (" key=value ...") added to lib/pq's DSN.
func withDSNParams(d sqlDriver, params string) sqlDriver {
	open := d.open
	d.name += "-" + strings.Fields(params)[0]
	d.open = func(cfg *pgconn.Config, host string, port uint16, schema string) (*sql.DB, error) {
		return open(cfg, host, port, schema+params)
	}
	return d
}

// The conformance suite on both drivers, and on lib/pq also with
// binary_parameters=yes, which binds the prepared statements' bytea
// arguments in binary.
func TestDBConformance(t *testing.T) {
	t.Parallel()
	for _, d := range append(sqlDrivers, withDSNParams(sqlDrivers[1], " binary_parameters=yes")) {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			var mayskip []string
			if d.name != "pgx" {
				mayskip = append(mayskip, watchRules...) // waiters poll
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

// An acquire without a value stores NULL, alone or in a batch, whatever
// the driver (lib/pq sends a nil []byte, and a nil element of a bytea
// array, as an empty bytea), and one with a value stores it.
func TestDBNoValueIsNULL(t *testing.T) {
	t.Parallel()
	for _, d := range sqlDrivers {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			bundle, b := dbBundle(t, d, Options{})
			ctx := testCtx(t)
			acquireOK(t, b, "alone", "o", time.Minute)
			holdQueue(b.acquireQ)
			reqs := []sqllock.AcquireRequest{
				{Key: "none", Owner: "o", TTL: time.Minute},
				{Key: "some", Owner: "o", TTL: time.Minute, Value: []byte{0, 'v', 0xff}},
			}
			var chs []chan acquireResult
			for i, r := range reqs {
				chs = append(chs, goAcquireReq(ctx, b, r))
				waitQueued(t, b.acquireQ, i+1)
			}
			flushQueue(b.acquireQ)
			for _, ch := range chs {
				require.NoError(t, recv(t, ch).err)
			}
			unholdQueue(t, b.acquireQ)
			require.EqualValues(t, 1, b.acquireQ.Batches())
			rows, err := bundle.db.Pool.Query(ctx, "SELECT key, value FROM "+b.table+" ORDER BY key")
			require.NoError(t, err)
			got := map[string][]byte{}
			for rows.Next() {
				var k string
				var v []byte
				require.NoError(t, rows.Scan(&k, &v))
				got[k] = v
			}
			require.NoError(t, rows.Err())
			require.Nil(t, got["alone"], "a single acquire without a value stored %q", got["alone"])
			require.Nil(t, got["none"], "a batch member without a value stored %q", got["none"])
			require.Equal(t, []byte{0, 'v', 0xff}, got["some"])
			infos, err := b.List(ctx, "some")
			require.NoError(t, err)
			require.Equal(t, []byte{0, 'v', 0xff}, infos[0].Value)
		})
	}
}

// One round trip per operation on a *sql.DB, once warm: under pgx's
// stdlib driver, and under lib/pq, whose statements the Backend prepares
// once per connection, with or without binary_parameters=yes. Unnamed
// (Options.UnnamedStatements), lib/pq's default sends each statement with
// arguments in two (prepare, then bind and execute), as
// docs/postgres-sqldb.md says.
func TestDBRoundTripsPerOperation(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name    string
		d       sqlDriver
		params  string
		unnamed bool
		trips   int64
	}{
		{"pgx", sqlDrivers[0], "", false, 1},
		{"pq", sqlDrivers[1], "", false, 1}, {"pq-binary", sqlDrivers[1], " binary_parameters=yes", false, 1},
		{"pq-unnamed", sqlDrivers[1], "", true, 2}, {"pq-unnamed-binary", sqlDrivers[1], " binary_parameters=yes", true, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			bundle := newBundle(t, Options{})
			cfg, err := pgconn.ParseConfig(bundle.db.URL)
			require.NoError(t, err)
			p := newSyncCounter(t, net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))))
			d := tc.d
			if tc.params != "" {
				open := d.open
				d.open = func(cfg *pgconn.Config, host string, port uint16, schema string) (*sql.DB, error) {
					return open(cfg, host, port, schema+tc.params)
				}
			}
			db := openDB(t, bundle, d, p.addr())
			db.SetMaxOpenConns(1) // every statement on the one warmed connection
			b := newDBBackend(t, bundle, db, Options{DisableGroupCommit: true, UnnamedStatements: tc.unnamed})
			ctx := testCtx(t)
			// Warm: the pooler check, the schema version, the statements
			// prepared (pgx's statement cache, or the Backend's under lib/pq).
			l := acquireOK(t, b, "warm", "o", time.Minute)
			_, err = b.TryRenew(ctx, l, time.Minute)
			require.NoError(t, err)
			_, err = b.TryRenewBatch(ctx, []sqllock.RenewRequest{{Lease: l, TTL: time.Minute}})
			require.NoError(t, err)
			require.NoError(t, b.Release(ctx, l))
			trips := func(op func() error) int64 {
				n := p.trips.Load()
				require.NoError(t, op())
				return p.trips.Load() - n
			}
			require.Equal(t, tc.trips, trips(func() error {
				l, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", Owner: "o", TTL: time.Minute})
				return err
			}), "acquire")
			require.Equal(t, tc.trips, trips(func() error { _, err := b.TryRenew(ctx, l, time.Minute); return err }), "renew")
			l2 := acquireOK(t, b, "k2", "o", time.Minute)
			require.Equal(t, tc.trips, trips(func() error {
				res, err := b.TryRenewBatch(ctx, []sqllock.RenewRequest{{Lease: l, TTL: time.Minute}, {Lease: l2, TTL: time.Minute}})
				for _, r := range res {
					require.NoError(t, r.Err)
				}
				return err
			}), "batch renewal")
			require.Equal(t, tc.trips, trips(func() error { return b.Release(ctx, l) }), "release")
		})
	}
}

// Under lib/pq the Backend prepares each statement once per connection
// when the connection reaches the server itself, and sends it unnamed
// with Options.UnnamedStatements. A statement the session lost (DEALLOCATE
// ALL, DISCARD ALL: the server refuses its bind, before it runs) is
// prepared again and sent once more.
func TestDBLibPQPreparedStatements(t *testing.T) {
	t.Parallel()
	for _, unnamed := range []bool{false, true} {
		t.Run(fmt.Sprintf("unnamed=%v", unnamed), func(t *testing.T) {
			t.Parallel()
			bundle := newBundle(t, Options{})
			db := openDB(t, bundle, sqlDrivers[1], "")
			db.SetMaxOpenConns(1) // the test's statements on the Backend's one connection
			b := newDBBackend(t, bundle, db, Options{DisableGroupCommit: true, UnnamedStatements: unnamed})
			ctx := testCtx(t)
			prepared := func() int {
				var n int
				require.NoError(t, db.QueryRowContext(ctx, "SELECT count(*) FROM pg_prepared_statements").Scan(&n))
				return n
			}
			l := acquireOK(t, b, "k", "o", time.Minute)
			_, err := b.TryRenew(ctx, l, time.Minute)
			require.NoError(t, err)
			require.NoError(t, b.Release(ctx, l))
			require.Equal(t, !unnamed, b.named())
			if unnamed {
				require.Zero(t, prepared(), "statements prepared though unnamed ones were asked for")
				return
			}
			require.Equal(t, 3, prepared(), "acquire, renew and release, each prepared once")
			require.Equal(t, 1, b.prepared.size())
			for i := range 10 {
				l := acquireOK(t, b, fmt.Sprintf("key%d", i), "o", time.Minute)
				require.NoError(t, b.Release(ctx, l))
			}
			require.Equal(t, 3, prepared(), "statements are per statement, never per key")

			for _, lose := range []string{"DEALLOCATE ALL", "DISCARD ALL"} {
				_, err = db.ExecContext(ctx, lose)
				require.NoError(t, err)
				l = acquireOK(t, b, "k", "o", time.Minute)
				_, err = b.TryRenew(ctx, l, time.Minute)
				require.NoError(t, err, "after %s", lose)
				require.NoError(t, b.Release(ctx, l), "after %s", lose)
				require.Equal(t, 3, prepared(), "after %s: prepared again", lose)
			}
			var token int64
			require.NoError(t, bundle.db.Pool.QueryRow(ctx, "SELECT token FROM "+b.table+" WHERE key = 'k'").Scan(&token))
			require.EqualValues(t, 3, token, "one grant per acquire")
		})
	}
}

// The statement cache keeps the statements of a bounded number of
// connections, the least recently used leaving first.
func TestStmtCacheBounded(t *testing.T) {
	t.Parallel()
	s := &stmtCache{conns: map[any]*connStmts{}, limit: func() int { return 4 }}
	conns := make([]*int, 10)
	for i := range conns {
		conns[i] = new(int)
	}
	for _, c := range conns[:4] {
		s.of(c).stmts["q"] = nil
	}
	s.of(conns[0]) // used again: conns[1] is now the least recently used
	s.of(conns[4])
	_, kept := s.conns[conns[1]]
	require.False(t, kept, "the least recently used connection stayed")
	_, kept = s.conns[conns[0]]
	require.True(t, kept, "a recently used connection left first")
	for _, c := range conns[5:] {
		s.of(c)
		require.LessOrEqual(t, s.size(), 4)
	}
	_, kept = s.conns[conns[0]]
	require.False(t, kept, "conns[0] outlived five newer connections")
	s.of(conns[9])
	_, kept = s.conns[conns[9]]
	require.True(t, kept)
	s.forget(conns[9])
	require.Equal(t, 3, s.size())
}
