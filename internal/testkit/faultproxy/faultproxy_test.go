package faultproxy_test

import (
	"bytes"
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/ashlock/ashlock/internal/testkit/faultproxy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// echo is a TCP echo server that remembers what it received.
type echo struct {
	ln net.Listener
	wg sync.WaitGroup

	mu   sync.Mutex
	got  bytes.Buffer
	conn []net.Conn
}

func newEcho(t *testing.T) *echo {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	e := &echo{ln: ln}
	e.wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			e.mu.Lock()
			e.conn = append(e.conn, c)
			e.mu.Unlock()
			e.wg.Go(func() {
				defer c.Close()
				buf := make([]byte, 1024)
				for {
					n, err := c.Read(buf)
					if n > 0 {
						e.mu.Lock()
						e.got.Write(buf[:n])
						e.mu.Unlock()
						_, _ = c.Write(buf[:n])
					}
					if err != nil {
						return
					}
				}
			})
		}
	})
	t.Cleanup(func() {
		ln.Close()
		e.mu.Lock()
		for _, c := range e.conn {
			c.Close()
		}
		e.mu.Unlock()
		e.wg.Wait()
	})
	return e
}

func (e *echo) received() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.got.String()
}

type testBundle struct {
	echo  *echo
	proxy *faultproxy.Proxy
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	e := newEcho(t)
	p, err := faultproxy.New(e.ln.Addr().String())
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, p.Close()) })
	return &testBundle{echo: e, proxy: p}
}

func dial(t *testing.T, p *faultproxy.Proxy) net.Conn {
	t.Helper()
	c, err := net.Dial("tcp", p.Addr())
	require.NoError(t, err)
	t.Cleanup(func() { c.Close() })
	return c
}

// roundTrip writes s and reads len(s) bytes back within d.
func roundTrip(c net.Conn, s string, d time.Duration) (string, error) {
	if _, err := c.Write([]byte(s)); err != nil {
		return "", err
	}
	return readN(c, len(s), d)
}

func readN(c net.Conn, n int, d time.Duration) (string, error) {
	_ = c.SetReadDeadline(time.Now().Add(d))
	buf := make([]byte, n)
	_, err := io.ReadFull(c, buf)
	return string(buf), err
}

// patience bounds every wait for something that must happen: it is only
// reached when the test fails, so it is generous, for a loaded machine.
const patience = 10 * time.Second

// quiet is how long a read waits to show that nothing arrives. A late
// reply would not be noticed, so each test also checks, through Stats and
// the echo server, that the proxy has really processed the bytes.
const quiet = 200 * time.Millisecond

// eventually polls cond until it holds or patience runs out.
func eventually(t *testing.T, cond func() bool, msg string) {
	t.Helper()
	require.Eventually(t, cond, patience, 5*time.Millisecond, msg)
}

func TestPass(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	c := dial(t, tb.proxy)
	got, err := roundTrip(c, "hello", patience)
	require.NoError(t, err)
	require.Equal(t, "hello", got)
	require.Equal(t, 1, tb.proxy.Stats().Accepted)
}

func TestBlackholeDropsAndPassResumes(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	c := dial(t, tb.proxy)
	_, err := roundTrip(c, "a", patience)
	require.NoError(t, err)
	tb.proxy.Set(faultproxy.Blackhole)
	_, err = roundTrip(c, "lost", quiet)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	// The bytes must be dropped before Pass, or Pass would forward them.
	eventually(t, func() bool { return tb.proxy.Stats().Dropped == 4 }, "the blackholed bytes are dropped")
	require.Equal(t, "a", tb.echo.received(), "the server never saw the blackholed bytes")
	tb.proxy.Pass()
	got, err := roundTrip(c, "b", patience)
	require.NoError(t, err)
	require.Equal(t, "b", got, "the dropped bytes stay dropped after Pass")
	require.Equal(t, int64(4), tb.proxy.Stats().Dropped)
	require.Equal(t, "ab", tb.echo.received())
}

func TestHoldDeliversLater(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	c := dial(t, tb.proxy)
	_, err := roundTrip(c, "a", patience)
	require.NoError(t, err)
	tb.proxy.Set(faultproxy.Hold)
	_, err = roundTrip(c, "held", quiet)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded)
	// The bytes must be in the proxy's queue before Pass, or Pass would
	// only show that they pass, not that Hold delivers them later.
	eventually(t, func() bool { return tb.proxy.Stats().Queued == 4 }, "the held bytes are queued")
	require.Equal(t, "a", tb.echo.received(), "held bytes are not delivered")
	tb.proxy.Pass()
	got, err := readN(c, 4, patience)
	require.NoError(t, err)
	require.Equal(t, "held", got)
	require.Equal(t, "aheld", tb.echo.received())
}

// Bytes held when the client closes are still delivered on Pass, before
// the server side is closed.
func TestHoldDeliversAfterClientClosed(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	c := dial(t, tb.proxy)
	_, err := roundTrip(c, "a", patience)
	require.NoError(t, err)
	tb.proxy.Set(faultproxy.Hold)
	_, err = c.Write([]byte("late"))
	require.NoError(t, err)
	require.NoError(t, c.Close())
	eventually(t, func() bool { return tb.proxy.Stats().Queued == 4 }, "queued")
	tb.proxy.Pass()
	eventually(t, func() bool { return tb.echo.received() == "alate" }, "delivered after the close")
	eventually(t, func() bool { return tb.proxy.Stats().Open == 0 }, "closed")
}

func TestLatency(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	c := dial(t, tb.proxy)
	tb.proxy.SetLatency(100*time.Millisecond, 0)
	start := time.Now()
	got, err := roundTrip(c, "slow", patience)
	require.NoError(t, err)
	require.Equal(t, "slow", got)
	require.GreaterOrEqual(t, time.Since(start), 200*time.Millisecond, "one delay each way")
}

func TestResetAndRefuse(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	c := dial(t, tb.proxy)
	_, err := roundTrip(c, "a", patience)
	require.NoError(t, err)
	tb.proxy.Reset()
	_, err = readN(c, 1, patience)
	require.Error(t, err)
	require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "reset, not silent: %v", err)
	require.Equal(t, 1, tb.proxy.Stats().Resets)

	tb.proxy.Refuse(true)
	// The refusal (an accept followed by a reset) shows either in the dial
	// itself or in the first round trip, depending on when the RST arrives.
	c2, err := net.Dial("tcp", tb.proxy.Addr())
	if err == nil {
		t.Cleanup(func() { c2.Close() })
		_, err = roundTrip(c2, "x", patience)
	}
	require.Error(t, err)
	require.False(t, errors.Is(err, os.ErrDeadlineExceeded), "refused, not silent: %v", err)
	eventually(t, func() bool { return tb.proxy.Stats().Refused == 1 }, "refused")

	tb.proxy.Refuse(false)
	c3 := dial(t, tb.proxy)
	got, err := roundTrip(c3, "ok", patience)
	require.NoError(t, err)
	require.Equal(t, "ok", got)
}

func TestBlackholeRepliesAfterMatch(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	other := dial(t, tb.proxy)
	c := dial(t, tb.proxy)
	_, err := roundTrip(c, "before", patience)
	require.NoError(t, err)
	tb.proxy.BlackholeRepliesAfter([]byte("COMMIT-ME"))
	const req = "xxCOMMIT-MExx"
	_, err = roundTrip(c, req, quiet)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "no reply")
	eventually(t, func() bool { return tb.echo.received() == "before"+req }, "the request reached the server")
	require.Equal(t, 1, tb.proxy.Stats().Matched)
	// The server's reply, all of it, was dropped, not merely late: nothing
	// can arrive any more.
	eventually(t, func() bool { return tb.proxy.Stats().Dropped == int64(len(req)) }, "the reply is dropped")
	_, err = readN(c, 1, quiet)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "the reply is lost")
	// Other connections are untouched, and the match was one-shot.
	got, err := roundTrip(other, "COMMIT-ME", patience)
	require.NoError(t, err)
	require.Equal(t, "COMMIT-ME", got)
}

// BlackholeOpen cuts the connections open at that instant, both ways and
// silently, while a connection made afterwards passes.
func TestBlackholeOpenCutsOnlyOpenConnections(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	old := dial(t, tb.proxy)
	_, err := roundTrip(old, "a", patience)
	require.NoError(t, err)
	require.Equal(t, 1, tb.proxy.BlackholeOpen())
	_, err = roundTrip(old, "lost", quiet)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "a half-open connection gets no reply, and no error either")
	eventually(t, func() bool { return tb.proxy.Stats().Dropped == 4 }, "the bytes sent on the half-open connection are dropped")
	fresh := dial(t, tb.proxy)
	got, err := roundTrip(fresh, "b", patience)
	require.NoError(t, err)
	require.Equal(t, "b", got, "a connection made after the cut passes")
	require.Equal(t, "ab", tb.echo.received(), "the server never saw what was sent on the half-open connection")
	tb.proxy.Pass()
	_, err = roundTrip(old, "c", quiet)
	require.ErrorIs(t, err, os.ErrDeadlineExceeded, "a half-open connection stays cut")
	st := tb.proxy.Stats()
	require.Equal(t, 1, st.HalfOpen)
	require.Equal(t, 2, st.Open)
}
