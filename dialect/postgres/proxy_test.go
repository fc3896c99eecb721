package postgres

import (
	"encoding/binary"
	"errors"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
)

// syncCounter is a TCP proxy to a PostgreSQL server that counts the
// messages after which a client waits for the server: Sync (extended
// protocol) and Query (simple protocol). Each one is a round trip.
type syncCounter struct {
	ln     net.Listener
	target string
	trips  atomic.Int64
	wg     sync.WaitGroup
}

func newSyncCounter(t *testing.T, target string) *syncCounter {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	p := &syncCounter{ln: ln, target: target}
	p.wg.Go(p.accept)
	t.Cleanup(func() {
		ln.Close()
		p.wg.Wait()
	})
	return p
}

func (p *syncCounter) addr() string { return p.ln.Addr().String() }

func (p *syncCounter) accept() {
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		server, err := net.Dial("tcp", p.target)
		if err != nil {
			client.Close()
			continue
		}
		p.wg.Go(func() {
			_, _ = io.Copy(client, server)
			client.Close()
		})
		p.wg.Go(func() {
			_ = p.clientToServer(client, server)
			server.Close()
		})
	}
}

// clientToServer forwards the client's messages, counting round trips. The
// first messages have no type byte: SSLRequest or GSSENCRequest (answered
// with one byte) and then the StartupMessage.
func (p *syncCounter) clientToServer(client, server net.Conn) error {
	const sslRequest, gssRequest = 80877103, 80877104
	for {
		var head [8]byte
		if _, err := io.ReadFull(client, head[:]); err != nil {
			return err
		}
		n := binary.BigEndian.Uint32(head[:4])
		if n < 8 {
			return errors.New("bad startup message")
		}
		body := make([]byte, n-8)
		if _, err := io.ReadFull(client, body); err != nil {
			return err
		}
		if _, err := server.Write(append(head[:], body...)); err != nil {
			return err
		}
		if code := binary.BigEndian.Uint32(head[4:]); code != sslRequest && code != gssRequest {
			break
		}
	}
	for {
		var head [5]byte
		if _, err := io.ReadFull(client, head[:]); err != nil {
			return err
		}
		if head[0] == 'S' || head[0] == 'Q' {
			p.trips.Add(1)
		}
		body := make([]byte, binary.BigEndian.Uint32(head[1:])-4)
		if _, err := io.ReadFull(client, body); err != nil {
			return err
		}
		if _, err := server.Write(append(head[:], body...)); err != nil {
			return err
		}
	}
}
