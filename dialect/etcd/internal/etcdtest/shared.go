package etcdtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/ashlock/ashlock/internal/testkit/etcdserver"
)

// Environment variables read by this package.
const (
	// EnvEndpoints names an etcd (comma-separated client URLs) to use
	// instead of starting one.
	EnvEndpoints = "SQLLOCK_ETCD_ENDPOINTS"
	// EnvRequire, set to 1, turns "no etcd found" from a skip into a
	// failure.
	EnvRequire = "SQLLOCK_REQUIRE_ETCD"
)

// shared is the test binary's one etcd, found or started on first use.
var shared struct {
	mu        sync.Mutex
	done      bool
	endpoints []string
	source    string
	cluster   *etcdserver.Cluster // nil for SQLLOCK_ETCD_ENDPOINTS
	missing   string              // why no etcd was found
}

// Main runs the package's tests and then stops the shared server, if one
// was started (keeping its directory, with the log, when tests failed).
func Main(m *testing.M) int {
	code := m.Run()
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.cluster != nil {
		if code != 0 {
			shared.cluster.KeepDir()
			fmt.Fprintf(os.Stderr, "etcdtest: kept %s\n", shared.cluster.Dir())
		}
		shared.cluster.Close()
		shared.cluster = nil
	}
	return code
}

// Endpoints returns the shared etcd's client URLs, starting a one-member
// server on first use when SQLLOCK_ETCD_ENDPOINTS is not set. Without an
// etcd the test is skipped, or fails when SQLLOCK_REQUIRE_ETCD=1.
func Endpoints(t testing.TB) []string {
	t.Helper()
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if !shared.done {
		shared.done = true
		begin := time.Now()
		findShared()
		if shared.missing == "" {
			fmt.Fprintf(os.Stderr, "etcdtest: using etcd from %s (ready in %v)\n",
				shared.source, time.Since(begin).Round(time.Millisecond))
		}
	}
	if shared.missing != "" {
		Unavailable(t, shared.missing)
	}
	return shared.endpoints
}

// Unavailable skips t, or fails it when SQLLOCK_REQUIRE_ETCD=1.
func Unavailable(t testing.TB, why string) {
	t.Helper()
	if os.Getenv(EnvRequire) == "1" {
		t.Fatalf("etcdtest: no etcd, and %s=1: %s", EnvRequire, why)
		return
	}
	t.Skipf("etcdtest: no etcd (set %s, or install Debian's etcd-server): %s", EnvEndpoints, why)
}

func findShared() {
	if eps := os.Getenv(EnvEndpoints); eps != "" {
		shared.endpoints = strings.Split(eps, ",")
		shared.source = EnvEndpoints + "=" + eps
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	c, err := etcdserver.Start(ctx, etcdserver.Options{})
	if err != nil {
		shared.missing = err.Error()
		return
	}
	shared.cluster = c
	shared.endpoints = c.Endpoints()
	shared.source = fmt.Sprintf("a local server %s (%s)", c.Bin(), c.Dir())
}

// NewClient returns a client of endpoints with a quiet logger and a short
// dial timeout; the caller closes it.
func NewClient(endpoints []string, dialOpts ...grpc.DialOption) (*clientv3.Client, error) {
	return clientv3.New(clientv3.Config{
		Endpoints:   endpoints,
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
		DialOptions: dialOpts,
	})
}

// Client returns a client of the shared etcd, closed in t.Cleanup.
func Client(t testing.TB) *clientv3.Client {
	t.Helper()
	cli, err := NewClient(Endpoints(t))
	if err != nil {
		t.Fatalf("etcdtest: client: %v", err)
	}
	t.Cleanup(func() { cli.Close() })
	return cli
}

// Prefix returns a key prefix unique to t, and deletes every key under it
// in t.Cleanup unless t failed (then it logs it).
func Prefix(t testing.TB, cli *clientv3.Client) string {
	t.Helper()
	var b [6]byte
	_, _ = rand.Read(b[:])
	prefix := "sqllock-test/" + hex.EncodeToString(b[:]) + "/"
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("etcdtest: kept keys under %q", prefix)
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := cli.Delete(ctx, prefix, clientv3.WithPrefix()); err != nil {
			t.Errorf("etcdtest: delete %q: %v", prefix, err)
		}
	})
	return prefix
}
