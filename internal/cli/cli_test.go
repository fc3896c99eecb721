package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/dialect/sqlite"
	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// testBundle runs the CLI in this process, with its own environment, its
// own streams and a signal source the test controls.
type testBundle struct {
	env     map[string]string
	sigs    chan chan<- os.Signal // the channel run registered, once
	stdin   string
	workDir string
}

func setup(t *testing.T) *testBundle {
	t.Helper()
	dir := t.TempDir()
	return &testBundle{
		env: map[string]string{
			"HOME":         filepath.Join(dir, "home"),
			EnvDatabaseURL: "sqlite:" + filepath.Join(dir, "locks.db"),
			"PATH":         os.Getenv("PATH"),
		},
		sigs:    make(chan chan<- os.Signal, 1),
		workDir: dir,
	}
}

// run runs the CLI with args and returns its exit status, stdout and stderr.
func (tb *testBundle) run(ctx context.Context, args ...string) (int, string, string) {
	var stdout, stderr bytes.Buffer
	e := &env{
		stdin:  strings.NewReader(tb.stdin),
		stdout: &stdout, stderr: &stderr,
		getenv: func(k string) string { return tb.env[k] },
		environ: func() []string {
			var kv []string
			for k, v := range tb.env {
				kv = append(kv, k+"="+v)
			}
			return kv
		},
		notify: func(c chan<- os.Signal, _ ...os.Signal) {
			select {
			case tb.sigs <- c:
			default:
			}
		},
		stopNotify: func(chan<- os.Signal) {},
	}
	code := e.run(ctx, args)
	return code, stdout.String(), stderr.String()
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

func TestRedact(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, want string }{
		{"postgres://admin:hunter2secret@db:5432/x", "postgres://admin:xxxxx@db:5432/x"},
		{"cannot parse `postgres://admin:hunter2secret@db:bad/x`: invalid port", "cannot parse `postgres://admin:xxxxx@db:bad/x`: invalid port"},
		{"postgres://db/x?sslmode=disable&password=hunter2secret", "postgres://db/x?sslmode=disable&password=xxxxx"},
		{"host=db password=hunter2secret user=admin", "host=db password=xxxxx user=admin"},
		{"host=db password='hunter 2 secret' user=admin", "host=db password=xxxxx user=admin"},
		{"host=db sslpassword=hunter2secret", "host=db sslpassword=xxxxx"},
		{"postgres://admin:p@ss/w@rd@db/x", "postgres://admin:xxxxx@db/x"},
		{"postgres://admin@db/x", "postgres://admin@db/x"},
		// Nothing but the password fields is touched.
		{"cannot reach admin at postgres, a database", "cannot reach admin at postgres, a database"},
		{"postgres://admin:admin@db/x user=admin", "postgres://admin:xxxxx@db/x user=admin"},
	} {
		require.Equal(t, tc.want, redact(tc.in), "input %q", tc.in)
	}
}

func TestResolveDatabase(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		url     string
		dialect migrations.Dialect
		path    string
		code    int // 0: no error
	}{
		{url: "postgres://u@db/x", dialect: migrations.Postgres},
		{url: "postgresql://u@db/x", dialect: migrations.Postgres},
		{url: "POSTGRES://u@db/x", dialect: migrations.Postgres},
		{url: "postgres://", dialect: migrations.Postgres}, // PG* variables fill it in
		{url: "sqlite:/tmp/a.db", dialect: migrations.SQLite, path: "/tmp/a.db"},
		{url: "sqlite:rel/a.db", dialect: migrations.SQLite, path: "rel/a.db"},
		{url: "sqlite:///tmp/a.db", dialect: migrations.SQLite, path: "/tmp/a.db"},
		{url: "/var/lib/locks.db", dialect: migrations.SQLite, path: "/var/lib/locks.db"},
		{url: "./locks.db", dialect: migrations.SQLite, path: "./locks.db"},
		{url: "sqlite:", code: ExitConfig},
		{url: "mongodb://u:p@db/x", code: ExitConfig},
		{url: "mysql://u:p@db/x", dialect: migrations.MariaDB},
		{url: "MariaDB://u@db:3307/x?tls=true", dialect: migrations.MariaDB},
		{url: "mariadb://u:p@db/", code: ExitConfig},
		{url: "mariadb://db/x", code: ExitConfig},
		{url: "mariadb://u@db:notaport/x", code: ExitConfig},
		{url: "mariadb://u@db/x?tls=maybe", code: ExitConfig},
		{url: "file:x.db", code: ExitConfig},
		{url: "postgres://u@db:notaport/x", code: ExitConfig},
		{url: "host=db user=app dbname=app", dialect: migrations.Postgres},
		{url: "dbname=app", dialect: migrations.Postgres},
		{url: "locks.sqlite3", dialect: migrations.SQLite, path: "locks.sqlite3"},
		{url: "sqlite:a=b", dialect: migrations.SQLite, path: "a=b"}, // explicit
		{url: "locks", code: ExitConfig},                             // ambiguous
		{url: "a=b.db", code: ExitConfig},
		{url: "dir/a=b.db", code: ExitConfig},
		{url: "host=db port=notaport", code: ExitConfig},
	} {
		e := &env{getenv: func(string) string { return "" }}
		d, err := e.resolveDatabase(tc.url)
		if tc.code != 0 {
			require.Error(t, err, tc.url)
			require.Equal(t, tc.code, exitCode(err), "%s: %v", tc.url, err)
			continue
		}
		require.NoError(t, err, tc.url)
		require.Equal(t, tc.dialect, d.dialect, tc.url)
		require.Equal(t, tc.path, d.path, tc.url)
		if d.pg != nil {
			require.Equal(t, defaultConnectTimeout, d.pg.ConnConfig.ConnectTimeout)
		}
	}
}

func TestResolveDatabasePrecedence(t *testing.T) {
	t.Parallel()
	envs := map[string]string{EnvDatabaseURL: "sqlite:/from/env.db", "HOME": "/home/u"}
	e := &env{getenv: func(k string) string { return envs[k] }}
	d, err := e.resolveDatabase("sqlite:/from/flag.db")
	require.NoError(t, err)
	require.Equal(t, "/from/flag.db", d.path)
	d, err = e.resolveDatabase("")
	require.NoError(t, err)
	require.Equal(t, "/from/env.db", d.path)
	delete(envs, EnvDatabaseURL)
	d, err = e.resolveDatabase("")
	require.NoError(t, err)
	require.True(t, d.defaultPath)
}

func TestDefaultPath(t *testing.T) {
	t.Parallel()
	get := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	p, err := defaultPath(get(map[string]string{"XDG_STATE_HOME": "/state", "HOME": "/home/u"}))
	require.NoError(t, err)
	require.Equal(t, "/state/sqllock/locks.db", p)
	p, err = defaultPath(get(map[string]string{"XDG_STATE_HOME": "relative", "HOME": "/home/u"}))
	require.NoError(t, err)
	require.Equal(t, "/home/u/.local/state/sqllock/locks.db", p)
	_, err = defaultPath(get(nil))
	require.Error(t, err)
}

func TestExitCode(t *testing.T) {
	t.Parallel()
	require.Equal(t, ExitUsage, exitCode(sqllock.ErrInvalidKey))
	require.Equal(t, ExitTempFail, exitCode(&sqllock.HeldError{Key: "k"}))
	require.Equal(t, ExitLeaseLost, exitCode(&sqllock.LostError{Key: "k"}))
	require.Equal(t, ExitConfig, exitCode(sqllock.ErrSchemaMissing))
	require.Equal(t, ExitUnavailable, exitCode(sqllock.ErrUnavailable))
	require.Equal(t, ExitFailure, exitCode(os.ErrNotExist))
	require.Equal(t, 42, exitCode(fail(42, "x")))
}

func TestHelp(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	for _, args := range [][]string{{"--help"}, {"help"}, {"help", "run"}, {"run", "--help"}, {"migrate", "-h"},
		{"list", "--help"}, {"release", "--help"}, {"bench", "--help"}} {
		code, stdout, stderr := tb.run(testCtx(t), args...)
		require.Equal(t, ExitOK, code, "%v", args)
		require.Empty(t, stderr, "%v", args)
		require.Contains(t, stdout, "sqllock", "%v", args)
		require.Regexp(t, `(?i)example`, stdout, "%v", args)
	}
	code, _, stderr := tb.run(testCtx(t))
	require.Equal(t, ExitUsage, code)
	require.Contains(t, stderr, "Commands:")
}

func TestBadInputOneLine(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	for _, tc := range []struct {
		args []string
		code int
	}{
		{[]string{"run", "--", "true"}, ExitUsage},
		{[]string{"run", "--key", "k", "--ttl", "soon", "--", "true"}, ExitUsage},
		{[]string{"run", "--key", "k", "--grace", "-1s", "--", "true"}, ExitUsage},
		{[]string{"run", "--key", strings.Repeat("k", 600), "--", "true"}, ExitUsage},
		{[]string{"run", "--key", "k", "--", "/nonexistent/cmd"}, ExitNotFound},
		{[]string{"list", "--database-url", "redis://h/0"}, ExitConfig},
		{[]string{"list", "--json", "extra"}, ExitUsage},
		{[]string{"release", "--key", "k"}, ExitUsage},
		{[]string{"migrate"}, ExitUsage},
		{[]string{"migrate", "down"}, ExitUsage},
		{[]string{"migrate", "sql", "--dialect", "oracle"}, ExitUsage},
		{[]string{"bench", "--duration", "0s"}, ExitUsage},
		{[]string{"nope"}, ExitUsage},
	} {
		code, stdout, stderr := tb.run(testCtx(t), tc.args...)
		require.Equal(t, tc.code, code, "%v: %s", tc.args, stderr)
		require.Empty(t, stdout, "%v", tc.args)
		require.Equal(t, 1, strings.Count(stderr, "\n"), "%v: %q", tc.args, stderr)
		require.NotContains(t, stderr, "goroutine", "%v", tc.args)
	}
}

func TestRunInProcess(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	tb.stdin = "from stdin\n"
	code, stdout, stderr := tb.run(testCtx(t), "run", "--key", "k", "--", "sh", "-c", `read l; echo "$SQLLOCK_KEY $SQLLOCK_TOKEN $l"`)
	require.Equal(t, 0, code, stderr)
	require.Equal(t, "k 1 from stdin\n", stdout)

	code, stdout, _ = tb.run(testCtx(t), "list", "--json")
	require.Equal(t, 0, code)
	var locks []map[string]any
	require.NoError(t, json.Unmarshal([]byte(stdout), &locks))
	require.Len(t, locks, 1)
	for _, field := range []string{"key", "held", "owner", "token", "deadline", "remaining_ms"} {
		require.Contains(t, locks[0], field)
	}
	require.Equal(t, false, locks[0]["held"])
	require.EqualValues(t, 1, locks[0]["token"])
}

// hold takes key in the bundle's default SQLite file as "test-holder"
// until the test ends.
func (tb *testBundle) hold(t *testing.T, ctx context.Context, key string) {
	t.Helper()
	holder, err := sqlite.Open(filepath.Join(tb.workDir, "locks.db"), sqlite.Options{})
	require.NoError(t, err)
	l, err := holder.TryAcquire(ctx, sqllock.AcquireRequest{Key: key, TTL: time.Minute, Owner: "test-holder"})
	require.NoError(t, err)
	t.Cleanup(func() {
		require.NoError(t, holder.Release(ctx, l))
		require.NoError(t, holder.Close())
	})
}

// A signal while run waits for the lock ends the wait: 128+N, and the
// command never runs.
func TestRunSignalWhileWaiting(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := testCtx(t)
	tb.hold(t, ctx, "busy")

	go func() {
		c := <-tb.sigs
		c <- syscall.SIGTERM
	}()
	marker := filepath.Join(tb.workDir, "ran")
	code, _, stderr := tb.run(ctx, "run", "--key", "busy", "--wait", "20s", "--", "touch", marker)
	require.Equal(t, 128+int(syscall.SIGTERM), code, stderr)
	require.Contains(t, stderr, "while acquiring \"busy\"; not run")
	require.NoFileExists(t, marker)
}

// A held key: exit 75 at once with --wait 0, naming the holder.
func TestRunNotAcquired(t *testing.T) {
	t.Parallel()
	tb := setup(t)
	ctx := testCtx(t)
	tb.hold(t, ctx, "busy")

	code, stdout, stderr := tb.run(ctx, "run", "--key", "busy", "--", "echo", "ran")
	require.Equal(t, ExitTempFail, code)
	require.Empty(t, stdout)
	require.Contains(t, stderr, `held by "test-holder" (token 1)`)
}

// TestREADMEMatchesHelp keeps the CLI's documentation true: every --flag
// that the README's CLI section or docs/cli.md names exists (as --help
// shows it), and every exit status in docs/cli.md's table is one sqllock
// --help documents.
func TestREADMEMatchesHelp(t *testing.T) {
	t.Parallel()
	readme, err := os.ReadFile("../../README.md")
	require.NoError(t, err)
	text := string(readme)
	start := strings.Index(text, "## The `sqllock` command")
	require.GreaterOrEqual(t, start, 0)
	section := text[start+1:]
	if end := strings.Index(section, "\n## "); end >= 0 {
		section = section[:end]
	}
	cliDoc, err := os.ReadFile("../../docs/cli.md")
	require.NoError(t, err)
	reference := string(cliDoc)

	tb := setup(t)
	var help strings.Builder
	for _, c := range commands() {
		code, stdout, _ := tb.run(testCtx(t), c.name, "--help")
		require.Equal(t, ExitOK, code)
		help.WriteString(stdout)
	}
	_, mainHelp, _ := tb.run(testCtx(t), "--help")
	for doc, text := range map[string]string{"README": section, "docs/cli.md": reference} {
		for _, m := range regexp.MustCompile(`--([a-z][a-z-]*)`).FindAllStringSubmatch(text, -1) {
			if m[1] == "help" {
				continue
			}
			require.Regexp(t, `(?m)^  --`+regexp.QuoteMeta(m[1])+`\b`, help.String(), "%s names --%s", doc, m[1])
		}
		require.NotContains(t, text, "go build -o sqllock ", "%s: writes into the sqllock/ package directory", doc)
	}
	rows := regexp.MustCompile(`(?m)^\| (\d+)(?: / (\d+))? \|`).FindAllStringSubmatch(reference, -1)
	require.NotEmpty(t, rows)
	for _, m := range rows {
		for _, code := range m[1:] {
			if code != "" {
				require.Regexp(t, `(?m)^  `+code+` `, mainHelp, "docs/cli.md's exit status %s", code)
			}
		}
	}
}

// TestErrorfFoldsJoinedErrors: an errors.Join (one error per line) prints
// on one line with a separator, not run together ("(8) context deadline").
func TestErrorfFoldsJoinedErrors(t *testing.T) {
	t.Parallel()
	var stderr bytes.Buffer
	e := &env{stderr: &stderr}
	e.errorf("sqllock run: %v", errors.Join(errors.New("busy (5)"), context.DeadlineExceeded))
	require.Equal(t, "sqllock run: busy (5); context deadline exceeded\n", stderr.String())
}

// A command's lease keeps the supervisor's margin: its local deadline, at
// which the supervisor SIGKILLs the command, is at least TTL/20 (at most
// 1 s) before the backend's deadline, whatever the TTL run or elect take.
func TestSupervisedLeaseMargin(t *testing.T) {
	e := &env{}
	for _, ttl := range []time.Duration{minRunTTL, 2 * time.Second, 30 * time.Second, 10 * time.Minute} {
		c, err := sqllock.New(memory.New(), e.clientOptions(ttl, &database{dialect: migrations.SQLite}))
		require.NoError(t, err, "TTL %v", ttl)
		g, err := c.TryAcquire(t.Context(), "k", nil)
		require.NoError(t, err)
		// The memory backend's deadline is its clock at the grant + TTL;
		// the local deadline is the send time + TTL - margin.
		want := min(ttl/20, time.Second)
		got := g.Lease().Deadline.Sub(g.LocalDeadline())
		require.GreaterOrEqual(t, got, want-time.Millisecond, "TTL %v: the local deadline is only %v before the backend's", ttl, got)
		require.NoError(t, c.Close(context.Background()))
	}
}

// TestParseMariaDB checks what a MariaDB URL becomes: the driver's
// configuration, with READ COMMITTED and the connect timeout unless the
// URL or --connect-timeout says otherwise.
func TestParseMariaDB(t *testing.T) {
	t.Parallel()
	e := &env{getenv: func(string) string { return "" }}
	d, err := e.database(dbFlags{url: "mariadb://u:p%40w%3A@db/x"})
	require.NoError(t, err)
	require.Equal(t, migrations.MariaDB, d.dialect)
	require.Equal(t, "mariadb://u:xxxxx@db/x", d.display)
	require.Equal(t, []string{"u", "p@w:", "tcp", "db:3306", "x"}, []string{d.my.User, d.my.Passwd, d.my.Net, d.my.Addr, d.my.DBName})
	require.Equal(t, map[string]string{"tx_isolation": "'READ-COMMITTED'", "innodb_lock_wait_timeout": "5"}, d.my.Params)
	require.Equal(t, defaultConnectTimeout, d.my.Timeout)
	require.Equal(t, defaultConnectTimeout, d.connectTimeout())

	d, err = e.database(dbFlags{url: "MySQL://u@[::1]:3307/x?transaction_isolation=SERIALIZABLE&timeout=2s&tls=skip-verify"})
	require.NoError(t, err)
	require.Equal(t, "[::1]:3307", d.my.Addr)
	require.Equal(t, map[string]string{"transaction_isolation": "SERIALIZABLE", "innodb_lock_wait_timeout": "5"}, d.my.Params)
	require.Equal(t, 2*time.Second, d.my.Timeout)
	require.Equal(t, "skip-verify", d.my.TLSConfig)

	d, err = e.database(dbFlags{url: "mariadb://u@/x?socket=/run/mysqld/mysqld.sock&timeout=2s", connectTimeout: 700 * time.Millisecond})
	require.NoError(t, err)
	require.Equal(t, []string{"unix", "/run/mysqld/mysqld.sock"}, []string{d.my.Net, d.my.Addr})
	require.Equal(t, 700*time.Millisecond, d.my.Timeout, "--connect-timeout wins")

	for _, bad := range []string{
		"mariadb://u@db/x?socket=/s.sock", // a host and a socket
		"mariadb://u@db/x/y",
		"mariadb://u@db/x?user=v",
		"mariadb://u:p/w@db/x",
	} {
		_, err := e.database(dbFlags{url: bad})
		require.Error(t, err, bad)
		require.Equal(t, ExitConfig, exitCode(err), "%s: %v", bad, err)
	}
}

// The session's Client gets the dialect's Backend itself, not the wrapper
// that closes it: through the wrapper the Client saw only sqllock.Backend,
// so run --wait polled instead of waking on a release and renewals were
// never batched.
func TestSessionClientSeesBackendCapabilities(t *testing.T) {
	t.Parallel()
	e := &env{getenv: func(string) string { return "" }}
	s, err := e.open(t.Context(), dbFlags{url: "sqlite:" + filepath.Join(t.TempDir(), "locks.db")},
		openOptions{client: func(d *database) sqllock.Options { return e.clientOptions(time.Minute, d) }})
	require.NoError(t, err)
	defer s.close()
	_, stop, ok := s.client.Watch("k")
	require.True(t, ok, "the session's Client cannot watch for releases: run --wait polls")
	stop()
}
