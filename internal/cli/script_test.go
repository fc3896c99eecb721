package cli

import (
	"context"
	"flag"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/rogpeppe/go-internal/testscript"

	"github.com/ashlock/ashlock/internal/cli/clitest"
	"github.com/ashlock/ashlock/internal/testkit/faultproxy"
	"github.com/ashlock/ashlock/internal/testkit/leakcheck"
	"github.com/ashlock/ashlock/internal/testkit/mariatest"
	"github.com/ashlock/ashlock/internal/testkit/pgtest"
	"github.com/ashlock/ashlock/migrations"
)

// TestMain builds nothing: testscript re-executes this test binary as the
// "sqllock" command (main's exact code path: sqllockMain), and after the
// tests stops the shared PostgreSQL and checks for leaked goroutines.
func TestMain(m *testing.M) {
	if cfg := os.Getenv(envSupervisor); cfg != "" {
		os.Exit(superviseMain(cfg)) // run's supervisor, started by a test in this process
	}
	testscript.Main(leakCheckedMain{m}, map[string]func(){
		"sqllock": sqllockMain,
		"exitto":  clitest.ExittoMain,
	})
}

type leakCheckedMain struct{ m *testing.M }

func (l leakCheckedMain) Run() int {
	raiseParallel()
	code := pgtest.Main(l.m)
	mariatest.Stop(code != 0)
	return leakcheck.Check(code)
}

// raiseParallel lets 4 parallel tests run at once (-test.parallel 4), not
// GOMAXPROCS (2 in CI), unless -test.parallel was given: the scripts
// spend their time waiting on timers and child processes, not computing
// (under -race, the whole package took 336s of real time for 50s of CPU
// with 2 at once, and 144s with 4, at a load average of 13 to 26 on 2
// cores).
func raiseParallel() {
	if !flag.Parsed() {
		flag.Parse()
	}
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == "test.parallel" })
	if p := flag.Lookup("test.parallel"); !set && p != nil && runtime.GOMAXPROCS(0) < 4 {
		_ = p.Value.Set("4")
	}
}

// sqllockMain is cmd/sqllock's main.
func sqllockMain() {
	if name := os.Getenv("SQLLOCKTEST_BEFORE_START"); name != "" {
		// Holds run between the acquire and COMMAND's start: writes
		// NAME.waiting and waits until NAME exists.
		beforeStart = func() {
			_ = os.WriteFile(name+".waiting", []byte("waiting\n"), 0o666)
			for i := 0; i < 3000; i++ {
				if _, err := os.Stat(name); err == nil {
					return
				}
				time.Sleep(10 * time.Millisecond)
			}
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := Run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

const scriptDir = "../../cmd/sqllock/testdata/script"

// TestScriptSQLite runs every script against a SQLite file in $WORK.
func TestScriptSQLite(t *testing.T) {
	t.Parallel()
	testscript.Run(t, scriptParams("sqlite", func(e *testscript.Env) error {
		e.Setenv(EnvDatabaseURL, "sqlite:"+filepath.Join(e.WorkDir, "locks.db"))
		return nil
	}))
}

// TestScriptPostgres runs every script against a fresh schema of a real
// PostgreSQL, with the lock table migrated. Without a server the scripts
// skip, except that they fail when SQLLOCK_REQUIRE_POSTGRES=1 (pgtest).
func TestScriptPostgres(t *testing.T) {
	t.Parallel()
	testscript.Run(t, scriptParams("postgres", func(e *testscript.Env) error {
		db := pgtest.New(e.T().(testing.TB))
		sqlDB := stdlib.OpenDBFromPool(db.Pool)
		defer sqlDB.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := migrations.Up(ctx, migrations.Postgres, sqlDB, migrations.Options{Schema: db.Schema}); err != nil {
			return err
		}
		e.Setenv(EnvDatabaseURL, db.URL)
		e.Setenv("PGSCHEMA", db.Schema)
		return nil
	}))
}

// TestScriptMariaDB runs the scripts that make sense on every server
// (mariaDBScripts) against a fresh database of a real MariaDB, with the
// lock table migrated. Without a server they skip, except that they fail
// when SQLLOCK_REQUIRE_MARIADB=1 (mariatest).
func TestScriptMariaDB(t *testing.T) {
	t.Parallel()
	p := scriptParams("mariadb", func(e *testscript.Env) error {
		tb := e.T().(testing.TB)
		s := mariatest.Server(tb)
		name := mariatest.Database(tb, s)
		db := mariatest.Open(tb, s.Addr, name)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := migrations.Up(ctx, migrations.MariaDB, db, migrations.Options{}); err != nil {
			return err
		}
		e.Setenv(EnvDatabaseURL, "mariadb://root@"+s.Addr+"/"+name)
		e.Setenv("MARIADB_ADDR", s.Addr)
		e.Setenv("MARIADB_DATABASE", name)
		return nil
	})
	p.Dir = ""
	for _, name := range mariaDBScripts {
		p.Files = append(p.Files, filepath.Join(scriptDir, name+".txtar"))
	}
	testscript.Run(t, p)
}

// mariaDBScripts are the scripts TestScriptMariaDB runs: MariaDB's own
// (migrate, run, list, release, passwords), and those of the other
// commands, and of losses, whose outcome depends on the backend. The rest
// test the CLI's own logic, which the SQLite and PostgreSQL runs cover.
var mariaDBScripts = []string{
	"mariadb",
	"run_basic",
	"run_contention",
	"run_lease_lost",
	"list_release",
	"elect",
	"elect_loss",
	"bench",
	"exit_codes",
	"conflict_exit_code",
	"prune",
}

func scriptParams(dialect string, setup func(*testscript.Env) error) testscript.Params {
	return clitest.Params(scriptDir, dialect, setup, map[string]func(ts *testscript.TestScript, neg bool, args []string){
		"readonly":   cmdReadonly,
		"blackhole":  cmdBlackhole,
		"stallproxy": cmdStallproxy,
		"kvdsn":      cmdKVDSN,
		"pgbouncer":  cmdPgBouncer,
		"refusingpg": cmdRefusingPG,
		"mariauser":  cmdMariaUser,
	})
}

// readonly file: makes file read-only for this process, also when it runs
// as root (which ignores permission bits): then with chattr +i, undone when
// the script ends. Skips the script if neither works.
func cmdReadonly(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) != 1 {
		ts.Fatalf("usage: readonly file")
	}
	name := ts.MkAbs(args[0])
	ts.Check(os.Chmod(name, 0o444))
	if os.Geteuid() != 0 {
		return
	}
	if out, err := exec.Command("chattr", "+i", name).CombinedOutput(); err != nil {
		ts.Logf("running as root and chattr +i failed (%v: %s): cannot make a file read-only", err, out)
		ts.Value(clitest.ScriptT{}).(testscript.T).Skip("cannot make a file read-only")
	}
	ts.Defer(func() { _ = exec.Command("chattr", "-i", name).Run() })
}

// blackhole VAR: listens on a local TCP port, accepts every connection and
// never answers (a server that hangs, or a firewall that swallows), and sets
// $VAR to its host:port. It stops when the script ends.
func cmdBlackhole(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) != 1 {
		ts.Fatalf("usage: blackhole VAR")
	}
	serveLocal(ts, args[0], func(net.Conn) {}) // held open, never read or written
}

// serveLocal listens on a local TCP port until the script ends, hands each
// connection to serve (on a goroutine of its own), and sets $name to its
// host:port. The connections still open at the end are closed.
func serveLocal(ts *testscript.TestScript, name string, serve func(net.Conn)) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	ts.Check(err)
	var (
		mu    sync.Mutex
		conns []net.Conn
	)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			go serve(c)
		}
	}()
	ts.Defer(func() {
		_ = ln.Close()
		<-done
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	ts.Setenv(name, ln.Addr().String())
}

// stallproxy VAR PATTERN: puts a proxy between the script and the
// PostgreSQL of $SQLLOCK_DATABASE_URL that passes everything until a
// request containing PATTERN goes through, and then never delivers that
// connection's replies (a server that stalls mid-statement). $VAR is set to
// the database URL through the proxy.
func cmdStallproxy(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) != 2 {
		ts.Fatalf("usage: stallproxy VAR PATTERN")
	}
	u, err := url.Parse(ts.Getenv(EnvDatabaseURL))
	ts.Check(err)
	p, err := faultproxy.New(u.Host)
	ts.Check(err)
	ts.Defer(func() { _ = p.Close() })
	p.BlackholeRepliesAfter([]byte(args[1]))
	u.Host = p.Addr()
	ts.Setenv(args[0], u.String())
}

// kvdsn VAR: sets $VAR to $SQLLOCK_DATABASE_URL (a PostgreSQL URL) written
// in keyword/value form: host=... port=... user=... dbname=... and its query
// parameters as keywords.
func cmdKVDSN(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) != 1 {
		ts.Fatalf("usage: kvdsn VAR")
	}
	u, err := url.Parse(ts.Getenv(EnvDatabaseURL))
	ts.Check(err)
	kv := []string{"host=" + u.Hostname(), "port=" + u.Port(), "user=" + u.User.Username(), "dbname=" + strings.TrimPrefix(u.Path, "/")}
	for k, vs := range u.Query() {
		for _, v := range vs {
			kv = append(kv, k+"="+v)
		}
	}
	ts.Setenv(args[0], strings.Join(kv, " "))
}

// pgbouncer VAR: starts PgBouncer in transaction mode in front of a fresh
// database of the test's PostgreSQL server, with the lock table migrated
// (directly: the migrations take a session lock), and sets $VAR to its URL
// through PgBouncer. Without a pgbouncer binary the script skips, or fails
// when SQLLOCK_REQUIRE_PGBOUNCER=1 (pgtest).
func cmdPgBouncer(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) != 1 {
		ts.Fatalf("usage: pgbouncer VAR")
	}
	t := ts.Value(clitest.ScriptT{}).(testscript.T).(testing.TB)
	b := pgtest.NewPgBouncer(t, pgtest.PoolTransaction, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	pool, err := pgxpool.New(ctx, b.DirectURL)
	ts.Check(err)
	defer pool.Close()
	db := stdlib.OpenDBFromPool(pool)
	defer db.Close()
	ts.Check(migrations.Up(ctx, migrations.Postgres, db, migrations.Options{}))
	ts.Setenv(args[0], b.URL)
}

// refusingpg VAR SQLSTATE MESSAGE: listens on a local TCP port as a
// PostgreSQL server that answers every connection's startup with an error
// of that SQLSTATE (28P01 for a wrong password, 3D000 for a missing
// database), and sets $VAR to its host:port. It stops when the script ends.
func cmdRefusingPG(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) != 3 {
		ts.Fatalf("usage: refusingpg VAR SQLSTATE MESSAGE")
	}
	serveLocal(ts, args[0], func(c net.Conn) {
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		b := pgproto3.NewBackend(c, c)
		for {
			m, err := b.ReceiveStartupMessage()
			if err != nil {
				return
			}
			switch m.(type) {
			case *pgproto3.SSLRequest, *pgproto3.GSSEncRequest:
				if _, err := c.Write([]byte("N")); err != nil {
					return
				}
				continue
			}
			b.Send(&pgproto3.ErrorResponse{Severity: "FATAL", Code: args[1], Message: args[2]})
			_ = b.Flush()
			return
		}
	})
}
