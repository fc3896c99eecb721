package pgserver

import (
	"context"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestFindBinDir(t *testing.T) {
	dir, reason := FindBinDir()
	if dir == "" {
		if os.Getenv("SQLLOCK_REQUIRE_POSTGRES") == "1" {
			t.Fatalf("no PostgreSQL binaries, and SQLLOCK_REQUIRE_POSTGRES=1: %s", reason)
		}
		t.Skipf("no PostgreSQL binaries: %s", reason)
	}
	if !hasServerBinaries(dir) {
		t.Fatalf("%s lacks the server binaries", dir)
	}
	if versionOf("/usr/lib/postgresql/17/bin") <= versionOf("/usr/lib/postgresql/9/bin") {
		t.Fatal("versionOf must order 17 above 9")
	}
}

// Start is what the benchmarks use: a durable server, with settings.
func TestStart(t *testing.T) {
	if dir, _ := FindBinDir(); dir == "" && os.Getenv("SQLLOCK_REQUIRE_POSTGRES") != "1" {
		t.Skip("no PostgreSQL binaries")
	}
	s, err := Start(Options{Durable: true, Settings: map[string]string{"max_connections": "33"}})
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(s.DataDir)
	defer s.Stop(StopImmediate)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, s.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close(ctx)
	var fsync, maxConns string
	if err := conn.QueryRow(ctx, "SELECT current_setting('fsync'), current_setting('max_connections')").Scan(&fsync, &maxConns); err != nil {
		t.Fatal(err)
	}
	if fsync != "on" || maxConns != "33" {
		t.Fatalf("fsync=%s max_connections=%s, want on and 33", fsync, maxConns)
	}
}
