package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgproto3"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"
	"github.com/rogpeppe/go-internal/testscript"

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
		"exitto":  exittoMain,
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

// exittoMain is the "exitto FILE PROGRAM ARGS..." command of the scripts:
// it runs PROGRAM with its stdio, forwards SIGINT and SIGTERM to it, writes
// its exit status (128+N for a death by signal N) to FILE and exits 0. It
// lets a script start sqllock in the background and check its exit status
// later, with testscript's end-of-test interrupt reaching sqllock.
func exittoMain() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: exitto FILE PROGRAM [ARGS...]")
		os.Exit(2)
	}
	cmd := exec.Command(os.Args[2], os.Args[3:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "exitto:", err)
		os.Exit(2)
	}
	go func() {
		for s := range sigs {
			_ = cmd.Process.Signal(s)
		}
	}()
	_ = cmd.Wait()
	code := cmd.ProcessState.ExitCode()
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		code = 128 + int(ws.Signal())
	}
	if err := os.WriteFile(os.Args[1], fmt.Appendf(nil, "%d\n", code), 0o666); err != nil {
		fmt.Fprintln(os.Stderr, "exitto:", err)
		os.Exit(2)
	}
	os.Exit(0)
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
	return testscript.Params{
		Dir:                 scriptDir,
		RequireExplicitExec: true,
		RequireUniqueNames:  true,
		Setup: func(e *testscript.Env) error {
			e.Setenv("HOME", filepath.Join(e.WorkDir, "home"))
			// The mutation check (.ci/mutants) names the mutant to switch
			// on in these; testscript starts each command with an
			// environment of its own.
			for _, k := range []string{"SQLLOCK_MUTANT_GO", "SQLLOCK_MUTANT_GO_REPORT"} {
				if v, ok := os.LookupEnv(k); ok {
					e.Setenv(k, v)
				}
			}
			e.Values[scriptT{}] = e.T()
			return setup(e)
		},
		Condition: func(cond string) (bool, error) {
			switch cond {
			case "sqlite", "postgres", "mariadb":
				return cond == dialect, nil
			}
			return false, fmt.Errorf("unknown condition %q", cond)
		},
		Cmds: map[string]func(ts *testscript.TestScript, neg bool, args []string){
			"exitcode":   cmdExitcode,
			"waitfile":   cmdWaitfile,
			"gone":       cmdGone,
			"readonly":   cmdReadonly,
			"blackhole":  cmdBlackhole,
			"sleep":      cmdSleep,
			"stallproxy": cmdStallproxy,
			"kvdsn":      cmdKVDSN,
			"pgbouncer":  cmdPgBouncer,
			"refusingpg": cmdRefusingPG,
			"mariauser":  cmdMariaUser,
		},
	}
}

// scriptT is the key of the script's testscript.T in Env.Values.
type scriptT struct{}

// exitcode [-within D] [-after D] N program args...: runs program like
// exec, and requires its exit status to be N (and, with -within, that it
// took at most D; with -after, at least D). stdout and stderr are kept for the next stdout/stderr
// commands.
func cmdExitcode(ts *testscript.TestScript, neg bool, args []string) {
	within, after := time.Duration(0), time.Duration(0)
	for len(args) >= 2 && (args[0] == "-within" || args[0] == "-after") {
		d, err := time.ParseDuration(args[1])
		if err != nil {
			ts.Fatalf("exitcode: %v", err)
		}
		if args[0] == "-within" {
			within = d
		} else {
			after = d
		}
		args = args[2:]
	}
	if neg || len(args) < 2 {
		ts.Fatalf("usage: exitcode [-within D] [-after D] N program [args...]")
	}
	want, err := strconv.Atoi(args[0])
	if err != nil {
		ts.Fatalf("exitcode: %v", err)
	}
	start := time.Now()
	err = ts.Exec(args[1], args[2:]...)
	if took := time.Since(start); within > 0 && took > within {
		ts.Fatalf("exitcode: %s took %v, more than %v", args[1], took.Round(time.Millisecond), within)
	}
	if took := time.Since(start); took < after {
		ts.Fatalf("exitcode: %s took %v, less than %v", args[1], took.Round(time.Millisecond), after)
	}
	got := 0
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		got = ee.ExitCode()
	case err != nil:
		ts.Fatalf("exitcode: %v", err)
	}
	if got != want {
		ts.Fatalf("exit status %d, want %d", got, want)
	}
}

// timeoutArg reads the "-timeout D" that may open the arguments of
// command name (default 15s), and returns the rest.
func timeoutArg(ts *testscript.TestScript, name string, args []string) (time.Duration, []string) {
	if len(args) < 2 || args[0] != "-timeout" {
		return 15 * time.Second, args
	}
	d, err := time.ParseDuration(args[1])
	if err != nil {
		ts.Fatalf("%s: %v", name, err)
	}
	return d, args[2:]
}

// waitfile [-timeout D] [-unless FILE2 REGEXP2] file [regexp]: waits until
// file exists (and its content matches regexp), polling; fails after the
// timeout (default 15s), and with -unless as soon as FILE2's content
// matches REGEXP2 (a state the script would fail on later anyway, seen
// without waiting out the timeout).
func cmdWaitfile(ts *testscript.TestScript, neg bool, args []string) {
	timeout, args := timeoutArg(ts, "waitfile", args)
	var unless string
	var unlessRe *regexp.Regexp
	if len(args) >= 3 && args[0] == "-unless" {
		unless, unlessRe = ts.MkAbs(args[1]), regexp.MustCompile(args[2])
		args = args[3:]
	}
	if neg || len(args) < 1 || len(args) > 2 {
		ts.Fatalf("usage: waitfile [-timeout D] [-unless file regexp] file [regexp]")
	}
	var re *regexp.Regexp
	if len(args) == 2 {
		re = regexp.MustCompile(args[1])
	}
	name := ts.MkAbs(args[0])
	deadline := time.Now().Add(timeout)
	for {
		data, err := os.ReadFile(name)
		if err == nil && (re == nil || re.Match(data)) {
			return
		}
		if unlessRe != nil {
			if u, err := os.ReadFile(unless); err == nil && unlessRe.Match(u) {
				ts.Fatalf("waitfile: %s matches %v before %s appeared (or matched %v); content %q", unless, unlessRe, name, re, u)
			}
		}
		if time.Now().After(deadline) {
			ts.Fatalf("waitfile: %s did not appear (or match %v) within %v; content %q", args[0], re, timeout, data)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// gone [-timeout D] pidfile: waits until the process whose pid the file
// holds no longer exists (or is a zombie of another parent).
func cmdGone(ts *testscript.TestScript, neg bool, args []string) {
	timeout, args := timeoutArg(ts, "gone", args)
	if neg || len(args) != 1 {
		ts.Fatalf("usage: gone [-timeout D] pidfile")
	}
	pid, err := strconv.Atoi(string(regexp.MustCompile(`\d+`).Find([]byte(ts.ReadFile(args[0])))))
	if err != nil {
		ts.Fatalf("gone: %v", err)
	}
	deadline := time.Now().Add(timeout)
	for alive(pid) {
		if time.Now().After(deadline) {
			ts.Fatalf("gone: process %d still runs after %v", pid, timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// alive reports whether pid runs (a zombie counts as gone).
func alive(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	m := regexp.MustCompile(`\) (\S)`).FindSubmatch(stat)
	return m == nil || string(m[1]) != "Z"
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
		ts.Value(scriptT{}).(testscript.T).Skip("cannot make a file read-only")
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

// sleep D: waits for the duration D.
func cmdSleep(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) != 1 {
		ts.Fatalf("usage: sleep duration")
	}
	d, err := time.ParseDuration(args[0])
	ts.Check(err)
	time.Sleep(d)
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
	t := ts.Value(scriptT{}).(testscript.T).(testing.TB)
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
