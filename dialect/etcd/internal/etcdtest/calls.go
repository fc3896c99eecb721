package etcdtest

import (
	"context"
	"fmt"
	"maps"
	"path"
	"slices"
	"strings"
	"sync"

	"google.golang.org/grpc"
)

// Calls counts the gRPC calls a client makes, by method: each unary call
// and each stream (a keep-alive of one lease opens one) is one round trip.
// Give [Calls.DialOptions] to [NewClient]. It is safe for concurrent use.
type Calls struct {
	mu sync.Mutex // guards n, fail
	n  map[string]int
	// fail, if set, runs after each unary call with its method and error
	// and returns the error the caller sees instead: a fault injected
	// after the server applied the request.
	fail func(method string, err error) error
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
			c.count(method)
			return streamer(ctx, desc, cc, method, opts...)
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
