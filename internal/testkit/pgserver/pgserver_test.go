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

// A standby streams, is read-only until promoted, then accepts writes; a
// PgBouncer in front of the server passes statements through, answers on
// its console, and comes back on its port after a kill -9.
func TestStandbyAndPgBouncer(t *testing.T) {
	if dir, _ := FindBinDir(); dir == "" && os.Getenv("SQLLOCK_REQUIRE_POSTGRES") != "1" {
		t.Skip("no PostgreSQL binaries")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := Start(Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(s.DataDir)
	defer s.Stop(StopImmediate)

	t.Run("Standby", func(t *testing.T) {
		sb, err := s.StartStandby(StandbyOptions{Name: "sb"})
		if err != nil {
			t.Fatal(err)
		}
		defer os.RemoveAll(sb.DataDir)
		defer sb.Stop(StopImmediate)
		if err := s.SetSynchronous(ctx, "sb"); err != nil {
			t.Fatal(err)
		}
		if err := s.WaitStreaming(ctx, "sb", "sync"); err != nil {
			t.Fatal(err)
		}
		readOnly := func() string {
			conn, err := pgx.Connect(ctx, sb.URL)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close(ctx)
			var ro string
			if err := conn.QueryRow(ctx, "SHOW transaction_read_only").Scan(&ro); err != nil {
				t.Fatal(err)
			}
			return ro
		}
		if ro := readOnly(); ro != "on" {
			t.Fatalf("standby: transaction_read_only = %s", ro)
		}
		if err := sb.Promote(); err != nil {
			t.Fatal(err)
		}
		if ro := readOnly(); ro != "off" {
			t.Fatalf("promoted: transaction_read_only = %s", ro)
		}
	})

	t.Run("PgBouncer", func(t *testing.T) {
		if p, reason := FindPgBouncer(); p == "" {
			if os.Getenv("SQLLOCK_REQUIRE_PGBOUNCER") == "1" {
				t.Fatal(reason)
			}
			t.Skip(reason)
		}
		b, err := StartPgBouncer(PgBouncerOptions{Target: s.URL, PoolMode: PoolSession})
		if err != nil {
			t.Fatal(err)
		}
		defer os.RemoveAll(b.Dir)
		defer b.Stop()
		pid := func() (fake, real uint32) {
			conn, err := pgx.Connect(ctx, b.URL("postgres"))
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close(ctx)
			if err := conn.QueryRow(ctx, "SELECT pg_backend_pid()").Scan(&real); err != nil {
				t.Fatal(err)
			}
			return conn.PgConn().PID(), real
		}
		if fake, real := pid(); fake == real {
			t.Fatalf("PgBouncer passed the server's backend PID %d through", real)
		}
		rows, err := b.Admin(ctx, "SHOW POOLS")
		if err != nil || len(rows) == 0 {
			t.Fatalf("SHOW POOLS: %v %v", rows, err)
		}
		b.Kill()
		if _, err := pgx.Connect(ctx, b.URL("postgres")); err == nil {
			t.Fatal("connected to a killed PgBouncer")
		}
		if err := b.Start(); err != nil {
			t.Fatal(err)
		}
		pid()
	})
}

// Clusters made from the one template are copies: what one server writes,
// another started after it does not see, and the template stays as initdb
// left it.
func TestClustersFromTheTemplateAreIndependent(t *testing.T) {
	if dir, _ := FindBinDir(); dir == "" && os.Getenv("SQLLOCK_REQUIRE_POSTGRES") != "1" {
		t.Skip("no PostgreSQL binaries")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	start := func() *pgx.Conn {
		t.Helper()
		begin := time.Now()
		s, err := Start(Options{})
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("started in %v", time.Since(begin).Round(time.Millisecond))
		t.Cleanup(func() { _ = os.RemoveAll(s.DataDir) })
		t.Cleanup(func() { _ = s.Stop(StopImmediate) })
		conn, err := pgx.Connect(ctx, s.URL)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close(context.Background()) })
		return conn
	}
	tables := func(conn *pgx.Conn) int {
		t.Helper()
		var n int
		if err := conn.QueryRow(ctx, "SELECT count(*) FROM pg_tables WHERE tablename = 'written_by_one'").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	one := start()
	if _, err := one.Exec(ctx, "CREATE TABLE written_by_one (x int); INSERT INTO written_by_one VALUES (1); CHECKPOINT"); err != nil {
		t.Fatal(err)
	}
	if n := tables(one); n != 1 {
		t.Fatalf("the first server sees %d tables of its own, want 1", n)
	}
	two := start()
	if n := tables(two); n != 0 {
		t.Fatalf("the second server sees the first one's table (%d)", n)
	}
}
