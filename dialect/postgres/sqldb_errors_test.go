package postgres

import (
	"context"
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/faultproxy"
	"github.com/ashlock/ashlock/sqllock"
)

// What a failed request's outcome is on a *sql.DB, per driver: a
// cancelled statement, a lost reply, a half-open connection.

// waitLockWaiters waits until n statements of bundle's server wait for a
// row lock.
func waitLockWaiters(t *testing.T, bundle *testBundle, n int) {
	t.Helper()
	require.Eventually(t, func() bool {
		var got int
		require.NoError(t, bundle.db.Pool.QueryRow(testCtx(t),
			"SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()").Scan(&got))
		return got >= n
	}, 10*time.Second, 5*time.Millisecond)
}

// A context cancelled while the statement is in flight surfaces
// differently per driver, and each answer must be true:
//   - pgx's stdlib driver gives up the connection (pgx's default context
//     watcher), the server runs the statement on to its commit: the
//     outcome is unknown, ErrIndeterminate, and the same owner's repeat
//     gets the grant back;
//   - lib/pq sends a cancel request, and the server answers that it
//     cancelled the statement (57014), which rolled it back: not
//     applied, and nothing was granted.
func TestDBCancelInFlight(t *testing.T) {
	t.Parallel()
	for _, d := range sqlDrivers {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			bundle, b := dbBundle(t, d, Options{DisableGroupCommit: true})
			acquireOK(t, b, "k", "o1", time.Minute)
			expire(t, b, "k")
			locker := holdRows(t, bundle.db.Pool, b.table, "FOR UPDATE", "k")
			ctx, cancel := context.WithCancel(testCtx(t))
			ch := goAcquire(ctx, b, "k", "o2")
			waitLockWaiters(t, bundle, 1)
			cancel()
			r := recv(t, ch)
			t.Log(r.err)
			require.NoError(t, locker.Rollback(testCtx(t)))
			switch d.name {
			case "pgx":
				require.ErrorIs(t, r.err, sqllock.ErrIndeterminate)
				l := acquireOK(t, b, "k", "o2", time.Minute)
				require.EqualValues(t, 2, l.Token, "the repeat gets the grant back")
			default:
				require.NotErrorIs(t, r.err, sqllock.ErrIndeterminate)
				require.ErrorIs(t, r.err, context.Canceled)
				require.ErrorContains(t, r.err, "not applied")
				var owner string
				var token int64
				require.NoError(t, bundle.db.Pool.QueryRow(testCtx(t), "SELECT owner, token FROM "+b.table+" WHERE key = 'k'").Scan(&owner, &token))
				require.Equal(t, "o1", owner, "a cancelled statement reported not applied was applied")
				require.EqualValues(t, 1, token)
			}
		})
	}
}

// A reply lost after the server committed (the connection breaks once
// the request is sent: reset, or closed, which lib/pq reads as EOF and
// reports as driver.ErrBadConn) is ErrIndeterminate on both drivers, and
// the same owner's repeat gets its grant back with its token; a request
// whose connection is refused before it is sent is not.
func TestDBLostReply(t *testing.T) {
	t.Parallel()
	for _, d := range sqlDrivers {
		for _, cut := range []string{"reset", "closed"} {
			t.Run(d.name+"/"+cut, func(t *testing.T) {
				t.Parallel()
				bundle := newBundle(t, Options{})
				cfg, err := pgconn.ParseConfig(bundle.db.URL)
				require.NoError(t, err)
				proxy, err := faultproxy.New(net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))))
				require.NoError(t, err)
				db := openDB(t, bundle, d, proxy.Addr())
				t.Cleanup(func() { proxy.Close() }) // before db: no half-open connection left
				b := newDBBackend(t, bundle, db, Options{})
				acquireOK(t, b, "warm", "o", time.Minute) // the pooler check and a first connection

				proxy.BlackholeRepliesAfter([]byte("lost/"))
				ch := goAcquire(testCtx(t), b, "k", "lost/o")
				require.Eventually(t, func() bool {
					var n int
					require.NoError(t, bundle.db.Pool.QueryRow(testCtx(t), "SELECT count(*) FROM "+b.table+" WHERE owner = 'lost/o' AND held").Scan(&n))
					return n == 1
				}, 10*time.Second, 5*time.Millisecond)
				if cut == "reset" {
					proxy.Reset()
				} else {
					proxy.Close()
				}
				r := recv(t, ch)
				t.Log(r.err)
				require.ErrorIs(t, r.err, sqllock.ErrIndeterminate)
				if cut == "closed" {
					l := acquireOK(t, bundle.backend, "k", "lost/o", time.Minute)
					require.EqualValues(t, 1, l.Token, "the repeat gets its grant back")
					return
				}
				proxy.Pass()
				l := acquireAfterReset(t, b, "k", "lost/o")
				require.EqualValues(t, 1, l.Token, "the repeat gets its grant back")

				// Refused before anything is sent: known not applied.
				db.SetMaxIdleConns(0) // no idle connection: the next one dials
				proxy.Refuse(true)
				_, err = b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k2", Owner: "o", TTL: time.Minute})
				t.Log(err)
				require.ErrorIs(t, err, sqllock.ErrUnavailable)
				require.NotErrorIs(t, err, sqllock.ErrIndeterminate)
				proxy.Refuse(false)
			})
		}
	}
}

// dbProxied is a Backend from NewDB through d and a fault proxy of its
// own on bundle's schema; the proxy closes before the *sql.DB.
func dbProxied(t *testing.T, bundle *testBundle, d sqlDriver, opts Options) (*Backend, *faultproxy.Proxy) {
	t.Helper()
	cfg, err := pgconn.ParseConfig(bundle.db.URL)
	require.NoError(t, err)
	proxy, err := faultproxy.New(net.JoinHostPort(cfg.Host, strconv.Itoa(int(cfg.Port))))
	require.NoError(t, err)
	db := openDB(t, bundle, d, proxy.Addr())
	t.Cleanup(func() { proxy.Close() })
	return newDBBackend(t, bundle, db, opts), proxy
}

// A batch of acquires whose reply is lost makes every member's outcome
// indeterminate on *sql.DB too, and each repeat gets its grant back.
func TestDBGroupCommitLostReply(t *testing.T) {
	t.Parallel()
	for _, d := range sqlDrivers {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			bundle := newBundle(t, Options{})
			b, proxy := dbProxied(t, bundle, d, Options{})
			ctx := testCtx(t)
			acquireOK(t, b, "warm", "o", time.Minute)

			holdQueue(b.acquireQ)
			keys := []string{"a", "b", "c"}
			var chs []chan acquireResult
			for i, k := range keys {
				chs = append(chs, goAcquire(ctx, b, k, "lost/"+k))
				waitQueued(t, b.acquireQ, i+1)
			}
			proxy.BlackholeRepliesAfter([]byte("lost/"))
			flushQueue(b.acquireQ)
			require.Eventually(t, func() bool {
				var n int
				require.NoError(t, bundle.db.Pool.QueryRow(ctx, "SELECT count(*) FROM "+b.table+" WHERE owner LIKE 'lost/%' AND held").Scan(&n))
				return n == len(keys)
			}, 10*time.Second, 5*time.Millisecond)
			proxy.Reset()
			for _, ch := range chs {
				r := recv(t, ch)
				require.ErrorIs(t, r.err, sqllock.ErrIndeterminate)
			}
			unholdQueue(t, b.acquireQ)
			proxy.Pass()
			for _, k := range keys {
				l := acquireAfterReset(t, b, k, "lost/"+k)
				require.EqualValues(t, 1, l.Token, "the repeat of %s gets its grant back", k)
			}
		})
	}
}

// A half-open connection (the reply never comes, and nothing tells the
// client) does not keep a call past its context on either driver: lib/pq
// reads the reply without its context, so the Backend stops waiting for
// it. The outcome is unknown, and the repeat gets the grant back.
func TestDBHalfOpenCallEndsWithContext(t *testing.T) {
	t.Parallel()
	for _, d := range sqlDrivers {
		t.Run(d.name, func(t *testing.T) {
			t.Parallel()
			bundle := newBundle(t, Options{})
			b, proxy := dbProxied(t, bundle, d, Options{})
			acquireOK(t, b, "warm", "o", time.Minute)
			proxy.BlackholeRepliesAfter([]byte("lost/"))
			ctx, cancel := context.WithTimeout(testCtx(t), 500*time.Millisecond)
			defer cancel()
			ch := goAcquire(ctx, b, "k", "lost/o")
			select {
			case r := <-ch:
				t.Log(r.err)
				require.ErrorIs(t, r.err, sqllock.ErrIndeterminate)
			case <-time.After(10 * time.Second):
				t.Fatal("the call outlived its context by 10s")
			}
			proxy.Reset() // the abandoned call ends; its connection is dropped
			proxy.Pass()
			l := acquireAfterReset(t, b, "k", "lost/o")
			require.EqualValues(t, 1, l.Token, "the repeat gets its grant back")
		})
	}
}

// acquireAfterReset is acquireOK after a proxy reset, which also broke the
// *sql.DB's idle connections: database/sql hands them out unchecked, so
// a call may meet one (an error of unknown outcome) before a live one.
func acquireAfterReset(t *testing.T, b *Backend, key, owner string) sqllock.Lease {
	t.Helper()
	var err error
	for range 3 {
		var l sqllock.Lease
		l, err = b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: key, Owner: owner, TTL: time.Minute})
		if err == nil {
			return l
		}
		require.ErrorIs(t, err, sqllock.ErrUnavailable)
	}
	require.NoError(t, err)
	return sqllock.Lease{}
}
