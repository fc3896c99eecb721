// Package mariatest is the MariaDB tests' harness: one server per test
// binary, started from the machine's binaries by internal/testkit/mariaserver,
// and a fresh database per test. Without a server the test is skipped, or
// fails when SQLLOCK_REQUIRE_MARIADB=1.
package mariatest

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/ashlock/ashlock/internal/testkit/mariaserver"
)

// EnvRequire, set to 1, turns "no MariaDB found" from a skip into a failure.
const EnvRequire = "SQLLOCK_REQUIRE_MARIADB"

var shared struct {
	mu      sync.Mutex
	done    bool
	server  *mariaserver.Server
	missing string
}

// Main runs the package's tests and then stops the shared server (keeping
// its directory, with the log, when tests failed).
func Main(m *testing.M) int {
	code := m.Run()
	Stop(code != 0)
	return code
}

// Stop stops the shared server, if one was started, keeping its directory
// (with the log) when failed: for a TestMain that runs its tests by other
// means than [Main].
func Stop(failed bool) {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.server != nil {
		if failed {
			fmt.Fprintf(os.Stderr, "mariatest: kept %s\n", shared.server.Dir)
		}
		shared.server.Close(failed)
		shared.server = nil
	}
}

// Unavailable skips t, or fails it when SQLLOCK_REQUIRE_MARIADB=1.
func Unavailable(t testing.TB, why string) {
	t.Helper()
	if os.Getenv(EnvRequire) == "1" {
		t.Fatalf("mariatest: no MariaDB, and %s=1: %s", EnvRequire, why)
		return
	}
	t.Skipf("mariatest: no MariaDB (install Debian's mariadb-server): %s", why)
}

// Server returns the shared server, started on first use.
func Server(t testing.TB) *mariaserver.Server {
	t.Helper()
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if !shared.done {
		shared.done = true
		begin := time.Now()
		// Durable, as the backend requires by default.
		s, err := mariaserver.Start(mariaserver.Options{Durable: true})
		if err != nil {
			shared.missing = err.Error()
		} else {
			shared.server = s
			fmt.Fprintf(os.Stderr, "mariatest: MariaDB at %s (%s), ready in %v\n", s.Addr, s.Dir, time.Since(begin).Round(time.Millisecond))
		}
	}
	if shared.missing != "" {
		Unavailable(t, shared.missing)
	}
	return shared.server
}

// Dedicated starts a server of t's own (for tests that kill or restart
// it), closed in t.Cleanup.
func Dedicated(t testing.TB, opts mariaserver.Options) *mariaserver.Server {
	t.Helper()
	if _, _, err := mariaserver.FindBinaries(); err != nil {
		Unavailable(t, err.Error())
	}
	s, err := mariaserver.Start(opts)
	if err != nil {
		t.Fatalf("mariatest: %v", err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("mariatest: kept %s", s.Dir)
		}
		s.Close(t.Failed())
	})
	return s
}

// DSN is the driver's data source name for database on addr, as root.
func DSN(addr, database string) string {
	c := mysql.NewConfig()
	c.User = "root"
	c.Net = "tcp"
	c.Addr = addr
	c.DBName = database
	c.Timeout = 5 * time.Second
	// READ COMMITTED per session, as the package doc recommends.
	c.Params = map[string]string{"tx_isolation": "'READ-COMMITTED'"}
	return c.FormatDSN()
}

// Database creates a fresh database on s for t and returns its name; it
// is dropped in t.Cleanup unless t failed.
func Database(t testing.TB, s *mariaserver.Server) string {
	t.Helper()
	var b [6]byte
	_, _ = rand.Read(b[:])
	name := "t_" + hex.EncodeToString(b[:])
	admin := Open(t, s.Addr, "")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE "+name); err != nil {
		t.Fatalf("mariatest: create database: %v", err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("mariatest: kept database %s on %s", name, s.Addr)
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		db, err := sql.Open("mysql", DSN(s.Addr, ""))
		if err != nil {
			return
		}
		defer db.Close()
		_, _ = db.ExecContext(ctx, "DROP DATABASE IF EXISTS "+name)
	})
	return name
}

// Open returns a handle on database at addr, closed in t.Cleanup.
func Open(t testing.TB, addr, database string) *sql.DB {
	t.Helper()
	db, err := sql.Open("mysql", DSN(addr, database))
	if err != nil {
		t.Fatalf("mariatest: open: %v", err)
	}
	t.Cleanup(func() { db.Close() })
	return db
}

// DB returns a handle on a fresh database of the shared server.
func DB(t testing.TB) *sql.DB {
	t.Helper()
	s := Server(t)
	return Open(t, s.Addr, Database(t, s))
}
