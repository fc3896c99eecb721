package mariadb

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/faultproxy"
	"github.com/ashlock/ashlock/internal/testkit/mariaserver"
	"github.com/ashlock/ashlock/internal/testkit/mariatest"
	"github.com/ashlock/ashlock/sqllock"
)

// proxied is a Backend whose connections go through a fault proxy to a
// fresh, migrated database of the shared server, and a direct handle on
// the same database.
func proxied(t *testing.T) (*Backend, *faultproxy.Proxy, *sql.DB) {
	t.Helper()
	s := mariatest.Server(t)
	name := mariatest.Database(t, s)
	direct := mariatest.Open(t, s.Addr, name)
	migrated(t, direct, Options{})
	p, err := faultproxy.New(s.Addr)
	require.NoError(t, err)
	t.Cleanup(func() { p.Close() })
	db := mariatest.Open(t, p.Addr(), name)
	b, err := New(db, Options{})
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })
	return b, p, direct
}

// An acquire whose reply is lost after the server applied it is
// ErrIndeterminate, never a guess; repeating it with the same owner
// returns the same grant, not a second tenure. The same for a release:
// indeterminate, and its repeat is harmless.
func TestLostReply(t *testing.T) {
	b, p, direct := proxied(t)
	key := "lost-reply-acquire-7f3a"
	p.BlackholeRepliesAfter([]byte(key))
	ctx, cancel := context.WithTimeout(testCtx(t), 500*time.Millisecond)
	_, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: "o1"})
	cancel()
	require.ErrorIs(t, err, sqllock.ErrIndeterminate)
	require.Equal(t, 1, p.Stats().Matched, "the reply was black-holed")
	p.Pass()

	other, err := New(direct, Options{})
	require.NoError(t, err)
	defer other.Close()
	i, err := other.List(testCtx(t), key)
	require.NoError(t, err)
	require.Len(t, i, 1)
	require.True(t, i[0].Held, "the server applied the acquire whose reply was lost")
	require.Equal(t, "o1", i[0].Owner)

	l, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: "o1"})
	require.NoError(t, err)
	require.Equal(t, i[0].Token, l.Token, "the repeat returns the same grant")

	p.BlackholeRepliesAfter([]byte(key))
	ctx, cancel = context.WithTimeout(testCtx(t), 500*time.Millisecond)
	err = b.Release(ctx, l)
	cancel()
	require.ErrorIs(t, err, sqllock.ErrIndeterminate)
	p.Pass()
	require.NoError(t, b.Release(testCtx(t), l), "repeating a release that was applied is harmless")
	i, err = other.List(testCtx(t), key)
	require.NoError(t, err)
	require.False(t, i[0].Held)
}

// A request that never reached the server is not indeterminate: the
// caller's ended context is its error alone.
func TestNotSentIsNotIndeterminate(t *testing.T) {
	b, _ := newBackend(t)
	ctx, cancel := context.WithCancel(testCtx(t))
	cancel()
	_, err := b.TryAcquire(ctx, acq("k"))
	require.ErrorIs(t, err, context.Canceled)
	require.NotErrorIs(t, err, sqllock.ErrIndeterminate)
	require.NotErrorIs(t, err, sqllock.ErrUnavailable)
}

// FencedTx commits the caller's writes only under the lease: a lost lease
// is refused before fn runs, and while fn runs no takeover can be granted,
// even past the lease's deadline.
func TestFencedTx(t *testing.T) {
	b, db := newBackend(t)
	_, err := db.ExecContext(testCtx(t), "CREATE TABLE counter (id INT PRIMARY KEY, n INT NOT NULL)")
	require.NoError(t, err)
	_, err = db.ExecContext(testCtx(t), "INSERT INTO counter VALUES (1, 0)")
	require.NoError(t, err)
	l, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: 300 * time.Millisecond, Owner: "o1"})
	require.NoError(t, err)

	inFn := make(chan struct{})
	granted := make(chan error, 1)
	err = b.FencedTx(testCtx(t), l, func(tx *sql.Tx) error {
		close(inFn)
		go func() {
			// Past the deadline: the takeover waits for the share lock.
			time.Sleep(400 * time.Millisecond)
			_, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o2"})
			granted <- err
		}()
		time.Sleep(800 * time.Millisecond)
		select {
		case err := <-granted:
			return fmt.Errorf("a takeover was answered while the fenced transaction ran: %v", err)
		default:
		}
		_, err := tx.ExecContext(testCtx(t), "UPDATE counter SET n = n + 1 WHERE id = 1")
		return err
	})
	require.NoError(t, err)
	<-inFn
	committed := time.Now()
	require.NoError(t, <-granted, "the takeover is granted after the commit")
	t.Logf("takeover answered %v after the commit", time.Since(committed))
	var n int
	require.NoError(t, db.QueryRowContext(testCtx(t), "SELECT n FROM counter WHERE id = 1").Scan(&n))
	require.Equal(t, 1, n)

	called := false
	err = b.FencedTx(testCtx(t), l, func(tx *sql.Tx) error { called = true; return nil })
	var lost *sqllock.LostError
	require.ErrorAs(t, err, &lost)
	require.Equal(t, sqllock.LostTaken, lost.Reason)
	require.False(t, called, "fn never runs under a lost lease")
}

// A server killed with SIGKILL and restarted (crash recovery) never hands
// out a token again: every grant it reported survived, with
// innodb_flush_log_at_trx_commit=1.
func TestKillAndRestartKeepsTokens(t *testing.T) {
	s := mariatest.Dedicated(t, mariaserver.Options{Durable: true})
	db := mariatest.Open(t, s.Addr, "mysql")
	_, err := db.ExecContext(testCtx(t), "CREATE DATABASE locks")
	require.NoError(t, err)
	db = mariatest.Open(t, s.Addr, "locks")
	db.SetConnMaxIdleTime(time.Second)
	migrated(t, db, Options{})
	b, err := New(db, Options{})
	require.NoError(t, err)
	defer b.Close()

	var last int64
	for i := range 50 {
		l, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: fmt.Sprint("o", i)})
		require.NoError(t, err)
		require.Greater(t, l.Token, last)
		last = l.Token
		require.NoError(t, b.Release(testCtx(t), l))
	}
	require.NoError(t, s.Kill())
	require.NoError(t, s.Start())

	// The pool's connections died with the server: the first use may fail
	// as unavailable (never as a grant), then the pool reconnects.
	var l sqllock.Lease
	deadline := time.Now().Add(30 * time.Second)
	for {
		l, err = b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "after"})
		if err == nil || time.Now().After(deadline) {
			break
		}
		require.True(t, errors.Is(err, sqllock.ErrUnavailable) || errors.Is(err, sqllock.ErrIndeterminate), "%v", err)
		time.Sleep(50 * time.Millisecond)
	}
	require.NoError(t, err)
	require.Greater(t, l.Token, last, "a token after the crash is above every token before it")
}

// Many clients on their own handles take one key in turn and increment a
// counter in a fenced transaction: no increment is lost, and the tokens
// of the sections are distinct and increasing in commit order.
func TestStormFencedCounter(t *testing.T) {
	s := mariatest.Server(t)
	name := mariatest.Database(t, s)
	setup := mariatest.Open(t, s.Addr, name)
	migrated(t, setup, Options{})
	_, err := setup.ExecContext(testCtx(t), "CREATE TABLE counter (id INT PRIMARY KEY, n INT NOT NULL, last_token BIGINT NOT NULL)")
	require.NoError(t, err)
	_, err = setup.ExecContext(testCtx(t), "INSERT INTO counter VALUES (1, 0, 0)")
	require.NoError(t, err)

	const workers, rounds = 8, 15
	var done, stale atomic.Int64
	var wg sync.WaitGroup
	for w := range workers {
		db := mariatest.Open(t, s.Addr, name)
		b, err := New(db, Options{})
		require.NoError(t, err)
		defer b.Close()
		c, err := sqllock.New(b, sqllock.Options{TTL: 2 * time.Second})
		require.NoError(t, err)
		defer c.Close(context.Background())
		wg.Go(func() {
			for range rounds {
				err := c.Do(testCtx(t), "storm", &sqllock.AcquireOptions{Wait: sqllock.WaitForever}, func(ctx context.Context, g *sqllock.Guard) error {
					return b.FencedTx(ctx, g.Lease(), func(tx *sql.Tx) error {
						res, err := tx.ExecContext(ctx, "UPDATE counter SET n = n + 1, last_token = ? WHERE id = 1 AND last_token < ?", g.Token(), g.Token())
						if err != nil {
							return err
						}
						if n, _ := res.RowsAffected(); n != 1 {
							stale.Add(1)
						}
						return nil
					})
				})
				if err != nil {
					t.Errorf("worker %d: %v", w, err)
					return
				}
				done.Add(1)
			}
		})
	}
	wg.Wait()
	var n int64
	require.NoError(t, setup.QueryRowContext(testCtx(t), "SELECT n FROM counter WHERE id = 1").Scan(&n))
	t.Logf("storm: %d sections, counter %d, stale writes %d", done.Load(), n, stale.Load())
	require.Equal(t, int64(workers*rounds), done.Load())
	require.Equal(t, done.Load(), n, "no increment lost")
	require.Zero(t, stale.Load(), "no section wrote with a token below one already written")
}
