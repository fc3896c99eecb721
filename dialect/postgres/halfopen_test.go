package postgres

import (
	"net"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/faultproxy"
	"github.com/ashlock/ashlock/sqllock"
)

// proxied is a Backend on bundle's schema through a fault proxy of its
// own, on a pool of maxConns connections (0: pgx's default); the proxy is
// closed before the pool, so that the pool's half-open connections end at
// once.
func proxied(t *testing.T, bundle *testBundle, maxConns int32) (*Backend, *faultproxy.Proxy) {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(bundle.db.URL)
	require.NoError(t, err)
	proxy, err := faultproxy.New(net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port))))
	require.NoError(t, err)
	pool := newPool(t, bundle, func(cfg *pgxpool.Config) {
		host, port, _ := net.SplitHostPort(proxy.Addr())
		p, _ := strconv.Atoi(port)
		cfg.ConnConfig.Host, cfg.ConnConfig.Port = host, uint16(p)
		cfg.ConnConfig.Fallbacks = nil
		cfg.ConnConfig.TLSConfig = nil
		if maxConns > 0 {
			cfg.MaxConns = maxConns
		}
	})
	t.Cleanup(func() { proxy.Close() })
	b, err := New(pool, Options{})
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })
	return b, proxy
}

// A listening connection that goes half-open delivers nothing, and says
// nothing, for as long as the kernel's keepalive takes (hours): a waiter
// then learns of releases only by polling, and loses every race for the
// key to waiters that are notified (an election candidate whose
// connections were cut won 1 term in 23 afterwards). The listener pings
// its connection when idle and replaces one that does not answer: waiters
// are woken again within the idle bound and the ping's.
func TestListenerReplacesHalfOpenConnection(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b, proxy := proxied(t, bundle, 2)
	b.listenIdle, b.listenPing = 300*time.Millisecond, 300*time.Millisecond
	ch, stop := b.Watch("k")
	defer stop()
	listening(t, b, ch)
	before := b.listener.listeningPID()

	require.Positive(t, proxy.BlackholeOpen())
	// Releases of k that a waiter marked, by clients on a direct
	// connection, until the watcher hears of one.
	other := bundle.backend
	// other watches k too, so that its refused attempts mark the lease
	// and its releases notify.
	och, stopOther := other.Watch("k")
	defer stopOther()
	listening(t, other, och)
	ctx := testCtx(t)
	cycle := func() {
		l, err := other.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "holder"})
		require.NoError(t, err)
		_, err = other.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "waiter"})
		require.ErrorIs(t, err, sqllock.ErrNotAcquired)
		require.NoError(t, other.Release(ctx, l))
	}
	start := time.Now()
	heard := false
	for !heard && time.Since(start) < 5*time.Second {
		cycle()
		select {
		case <-ch:
			heard = true
		case <-time.After(50 * time.Millisecond):
		}
	}
	require.True(t, heard, "no wake-up within 5 s of the cut: the listener kept its half-open connection")
	require.Eventually(t, func() bool {
		pid := b.listener.listeningPID()
		return pid != 0 && pid != before
	}, 5*time.Second, 10*time.Millisecond, "the listener listens on a new connection")
	t.Logf("RESULT test=TestListenerReplacesHalfOpenConnection woken_after=%v (idle bound %v, ping bound %v)", time.Since(start), b.listenIdle, b.listenPing)
	// Woken by the reconnect (or a release it heard): from now on each
	// release is heard.
	select {
	case <-ch:
	default:
	}
	cycle()
	wakeWithin(t, ch, 5*time.Second, "a release after the listener reconnected")
}
