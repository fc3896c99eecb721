package etcdtest

import (
	"context"
	"fmt"
	"maps"
	"path"
	"slices"
	"strings"
	"sync"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"google.golang.org/grpc"
)

// Calls counts the gRPC calls a client makes, by method: each unary call,
// each stream other than a lease keep-alive stream (a watch) and each
// keep-alive request sent on one is one round trip.
// Give [Calls.DialOptions] to [NewClient]. It is safe for concurrent use.
type Calls struct {
	mu sync.Mutex // guards n, streams, fail, keepAlive, ttls
	n  map[string]int
	// streams counts the lease keep-alive streams opened (each of their
	// requests counts in n).
	streams int
	// fail, if set, runs after each unary call with its method and error
	// and returns the error the caller sees instead: a fault injected
	// after the server applied the request.
	fail func(method string, err error) error
	// keepAlive, if set, runs before each keep-alive request is sent on a
	// lease stream, with the request's lease ID, and returns the TTL the
	// caller is to see in the reply for that lease instead of the
	// server's (0: the server's). See [Calls.SetKeepAlive].
	keepAlive func(id int64) int64
	ttls      map[int64]int64 // the TTLs to answer, by lease ID
}

// DialOptions are the interceptors that count.
func (c *Calls) DialOptions() []grpc.DialOption {
	return []grpc.DialOption{
		grpc.WithChainUnaryInterceptor(func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
			c.count(method)
			err := invoker(ctx, method, req, reply, cc, opts...)
			c.mu.Lock()
			fail := c.fail
			c.mu.Unlock()
			if fail != nil {
				err = fail(path.Base(method), err)
			}
			return err
		}),
		grpc.WithChainStreamInterceptor(func(ctx context.Context, desc *grpc.StreamDesc, cc *grpc.ClientConn, method string, streamer grpc.Streamer, opts ...grpc.CallOption) (grpc.ClientStream, error) {
			if path.Base(method) != "LeaseKeepAlive" {
				c.count(method)
				return streamer(ctx, desc, cc, method, opts...)
			}
			c.mu.Lock()
			c.streams++
			c.mu.Unlock()
			cs, err := streamer(ctx, desc, cc, method, opts...)
			if err != nil {
				return cs, err
			}
			return &keepAliveStream{ClientStream: cs, c: c}, nil
		}),
	}
}

func (c *Calls) count(method string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.n == nil {
		c.n = make(map[string]int)
	}
	c.n[path.Base(method)]++
}

// SetFail sets the fault hook (nil: none). See [Calls].
func (c *Calls) SetFail(fail func(method string, err error) error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.fail = fail
}

// KeepAliveStreams returns how many lease keep-alive streams were opened.
func (c *Calls) KeepAliveStreams() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.streams
}

// SetKeepAlive sets the keep-alive hook (nil: none): f runs before each
// keep-alive request is sent, with its lease ID, and may act on the
// cluster first (revoke the lease, say); a positive TTL it returns
// replaces the server's in the reply for that lease, whatever the server
// answered. That is how a test plays a server that answers a keep-alive
// with a positive TTL for a lease it has revoked (etcd-io/etcd#20547).
func (c *Calls) SetKeepAlive(f func(id int64) (ttl int64)) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.keepAlive = f
}

// keepAliveStream is a lease keep-alive stream under the hook of
// [Calls.SetKeepAlive].
type keepAliveStream struct {
	grpc.ClientStream
	c *Calls
}

func (s *keepAliveStream) SendMsg(m any) error {
	if req, ok := m.(*pb.LeaseKeepAliveRequest); ok {
		s.c.count("LeaseKeepAlive")
		s.c.mu.Lock()
		f := s.c.keepAlive
		s.c.mu.Unlock()
		if f != nil {
			if ttl := f(req.ID); ttl > 0 {
				s.c.mu.Lock()
				if s.c.ttls == nil {
					s.c.ttls = make(map[int64]int64)
				}
				s.c.ttls[req.ID] = ttl
				s.c.mu.Unlock()
			}
		}
	}
	return s.ClientStream.SendMsg(m)
}

func (s *keepAliveStream) RecvMsg(m any) error {
	err := s.ClientStream.RecvMsg(m)
	if resp, ok := m.(*pb.LeaseKeepAliveResponse); ok && err == nil {
		s.c.mu.Lock()
		if ttl, ok := s.c.ttls[resp.ID]; ok {
			delete(s.c.ttls, resp.ID)
			resp.TTL = ttl
		}
		s.c.mu.Unlock()
	}
	return err
}

// Take returns the calls counted since the last Take and starts again:
// the total, and "Method×n" by method in name order.
func (c *Calls) Take() (int, string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	total := 0
	var parts []string
	for _, m := range slices.Sorted(maps.Keys(c.n)) {
		total += c.n[m]
		parts = append(parts, fmt.Sprintf("%s×%d", m, c.n[m]))
	}
	c.n = nil
	return total, strings.Join(parts, " ")
}
