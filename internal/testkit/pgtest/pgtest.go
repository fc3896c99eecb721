package pgtest

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/url"
	"os"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ashlock/ashlock/internal/testkit/pgserver"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/moby/moby/client"
	"github.com/testcontainers/testcontainers-go"
	"github.com/testcontainers/testcontainers-go/modules/postgres"
)

// Environment variables read by this package.
const (
	// EnvURL names a server to use instead of finding or starting one.
	EnvURL = "SQLLOCK_POSTGRES_URL"
	// EnvRequire, set to 1, turns "no PostgreSQL found" from a skip into a
	// failure.
	EnvRequire = "SQLLOCK_REQUIRE_POSTGRES"
)

// DB is one test's schema on the shared server.
type DB struct {
	// Pool's connections use Schema as their search_path.
	Pool *pgxpool.Pool
	// Schema is a fresh, empty schema, unique to the test.
	Schema string
	// URL connects with search_path set to Schema; it works with
	// pgxpool.New, pgx.Connect and the pgx stdlib driver.
	URL string
	// AdminURL connects to the same database without a search_path.
	AdminURL string
}

// shared is the test binary's one server, found or started on first use.
var shared struct {
	mu       sync.Mutex
	done     bool
	adminURL string
	source   string
	stop     func(failed bool) // nil for SQLLOCK_POSTGRES_URL
	broken   error             // a source was found but did not work
	missing  string            // why no source was found
}

// Main runs the package's tests and then stops the shared server, if one was
// started. Use it in TestMain, followed by the goleak check:
//
//	func TestMain(m *testing.M) {
//		code := pgtest.Main(m)
//		if code == 0 { if err := goleak.Find(); err != nil { ...; code = 1 } }
//		os.Exit(code)
//	}
//
// When the tests failed, a local server's directory (with its log) is kept.
func Main(m *testing.M) int {
	code := m.Run()
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.stop != nil {
		shared.stop(code != 0)
		shared.stop = nil
	}
	return code
}

// New returns a fresh, empty schema on the shared server, and a pool whose
// connections use it as search_path. In t.Cleanup the pool is closed and the
// schema dropped; when the test failed the schema is kept and its URL logged
// (without a password). Without any server the test is skipped, or fails when
// SQLLOCK_REQUIRE_POSTGRES=1.
func New(t testing.TB) *DB {
	t.Helper()
	adminURL, source := sharedServer(t)
	schema := schemaName(t.Name())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := execAdmin(ctx, adminURL, "CREATE SCHEMA "+pgx.Identifier{schema}.Sanitize()); err != nil {
		t.Fatalf("pgtest: create schema %s on %s: %v", schema, URLForLog(adminURL), err)
	}
	db := &DB{Schema: schema, AdminURL: adminURL, URL: withParam(adminURL, "search_path", schema)}
	return db.open(t, ctx, source, "schema "+schema, adminURL, "DROP SCHEMA "+pgx.Identifier{schema}.Sanitize()+" CASCADE")
}

// open gives db its pool, and drops what (with dropSQL, sent to adminURL)
// in t.Cleanup unless the test failed.
func (db *DB) open(t testing.TB, ctx context.Context, source, what, adminURL, dropSQL string) *DB {
	t.Helper()
	pool, err := pgxpool.New(ctx, db.URL)
	if err != nil {
		t.Fatalf("pgtest: pool for %s: %v", URLForLog(db.URL), err)
	}
	db.Pool = pool
	t.Logf("pgtest: %s on %s", what, source)
	t.Cleanup(func() {
		pool.Close()
		if t.Failed() {
			t.Logf("pgtest: kept %s: %s", what, URLForLog(db.URL))
			return
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := execAdmin(ctx, adminURL, dropSQL); err != nil {
			t.Errorf("pgtest: drop %s: %v", what, err)
		}
	})
	return db
}

// NewDatabase is New in a fresh database of its own on the shared server,
// for a test of what PostgreSQL does per database: VACUUM keeps the row
// versions that any open transaction of the database may still see, and
// REINDEX CONCURRENTLY waits for every older transaction of the database,
// so the other tests' transactions (a fenced one held open on purpose)
// would hold such a test up. The database is dropped in t.Cleanup (kept,
// with its URL logged, when the test failed).
func NewDatabase(t testing.TB) *DB {
	t.Helper()
	adminURL, source := sharedServer(t)
	name := schemaName(t.Name())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dbURL := createDatabase(t, ctx, adminURL, name)
	if err := execAdmin(ctx, dbURL, "CREATE SCHEMA "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("pgtest: create schema %s in database %s: %v", name, name, err)
	}
	db := &DB{Schema: name, AdminURL: dbURL, URL: withParam(dbURL, "search_path", name)}
	return db.open(t, ctx, source, "database "+name, adminURL, "DROP DATABASE "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)")
}

// createDatabase creates the database name on the server of adminURL and
// returns adminURL with that database.
func createDatabase(t testing.TB, ctx context.Context, adminURL, name string) string {
	t.Helper()
	if err := execAdmin(ctx, adminURL, "CREATE DATABASE "+pgx.Identifier{name}.Sanitize()); err != nil {
		t.Fatalf("pgtest: create database %s on %s: %v", name, URLForLog(adminURL), err)
	}
	u, err := withDatabase(adminURL, name)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	return u
}

// URLForLog returns url without its password, for logs and messages. It
// handles URLs (postgres://user:pw@host/db?password=pw) and keyword/value
// strings (host=h password=pw).
func URLForLog(s string) string {
	if strings.Contains(s, "://") {
		u, err := url.Parse(s)
		if err != nil {
			return "(unparsable URL)"
		}
		if _, ok := u.User.Password(); ok {
			u.User = url.UserPassword(u.User.Username(), "xxxxx")
		}
		if q := u.Query(); q.Has("password") {
			q.Set("password", "xxxxx")
			u.RawQuery = q.Encode()
		}
		return u.String()
	}
	return dsnPassword.ReplaceAllString(s, "${1}xxxxx")
}

// dsnPassword matches a password in a keyword/value string, quoted or not.
var dsnPassword = regexp.MustCompile(`(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)`)

// unavailable skips t, or fails it when SQLLOCK_REQUIRE_POSTGRES=1.
func unavailable(t testing.TB, why string) {
	t.Helper()
	if os.Getenv(EnvRequire) == "1" {
		t.Fatalf("pgtest: no PostgreSQL, and %s=1: %s", EnvRequire, why)
		return
	}
	t.Skipf("pgtest: no PostgreSQL (set %s, or install PostgreSQL): %s", EnvURL, why)
}

// sharedServer returns the shared server's admin URL and a description of
// its source, finding or starting it on first use.
func sharedServer(t testing.TB) (adminURL, source string) {
	t.Helper()
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if !shared.done {
		shared.done = true
		begin := time.Now()
		findShared()
		if shared.adminURL != "" {
			fmt.Fprintf(os.Stderr, "pgtest: using PostgreSQL from %s (ready in %v)\n",
				shared.source, time.Since(begin).Round(time.Millisecond))
		}
	}
	switch {
	case shared.adminURL != "":
		return shared.adminURL, shared.source
	case shared.broken != nil:
		t.Fatalf("%v", shared.broken)
	default:
		unavailable(t, shared.missing)
	}
	return "", ""
}

// findShared tries the sources in order and fills in shared.
func findShared() {
	if u := os.Getenv(EnvURL); u != "" {
		shared.adminURL, shared.source = u, EnvURL+" ("+URLForLog(u)+")"
		return
	}
	reasons := []string{EnvURL + " not set"}
	var broken []error
	if err := dockerReachable(); err != nil {
		reasons = append(reasons, "no Docker engine: "+firstLine(err.Error()))
	} else if url, stop, err := runContainer(); err != nil {
		broken = append(broken, err)
		reasons = append(reasons, "testcontainers: "+err.Error())
	} else {
		shared.adminURL, shared.stop, shared.source = url, stop, "testcontainers (postgres:17-alpine)"
		return
	}
	binDir, why := pgserver.FindBinDir()
	if binDir == "" {
		reasons = append(reasons, why)
		if len(broken) > 0 {
			shared.broken = fmt.Errorf("pgtest: %s", strings.Join(reasons, "; "))
		}
		shared.missing = strings.Join(reasons, "; ")
		return
	}
	s, err := pgserver.StartLocal(binDir, ServerOptions{})
	if err != nil {
		broken = append(broken, err)
		shared.broken = errors.Join(broken...)
		return
	}
	shared.adminURL, shared.source = s.URL, fmt.Sprintf("%s on port %d (log %s)", binDir, s.Port, s.LogPath)
	shared.stop = func(failed bool) {
		if err := s.Stop(StopImmediate); err != nil {
			fmt.Fprintln(os.Stderr, err)
			failed = true
		}
		if failed {
			fmt.Fprintf(os.Stderr, "pgtest: kept %s; server log: %s\n", s.DataDir, s.LogPath)
			return
		}
		_ = os.RemoveAll(s.DataDir)
	}
}

// dockerReachable reports whether a Docker engine answers within 2 s. It
// checks as testcontainers.SkipIfProviderIsNotHealthy does, without skipping;
// testcontainers panics in some setups without an engine, so panics are
// errors here.
func dockerReachable() (err error) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	defer func() {
		if r := recover(); r != nil {
			err = fmt.Errorf("%v", r)
		}
	}()
	cli, err := testcontainers.NewDockerClientWithOpts(ctx)
	if err != nil {
		return err
	}
	defer cli.Close()
	_, err = cli.Ping(ctx, client.PingOptions{})
	return err
}

// runContainer starts postgres:17-alpine and returns its URL and a function
// that terminates it.
func runContainer() (string, func(bool), error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	ctr, err := postgres.Run(ctx, "postgres:17-alpine",
		postgres.BasicWaitStrategies(),
		testcontainers.WithCmd("postgres", "-c", "fsync=off", "-c", "synchronous_commit=off",
			"-c", "full_page_writes=off", "-c", "max_connections=200"),
	)
	stop := func(bool) {
		if err := testcontainers.TerminateContainer(ctr); err != nil {
			fmt.Fprintf(os.Stderr, "pgtest: terminate container: %v\n", err)
		}
	}
	if err != nil {
		stop(true)
		return "", nil, fmt.Errorf("start postgres:17-alpine: %w", err)
	}
	u, err := ctr.ConnectionString(ctx, "sslmode=disable")
	if err != nil {
		stop(true)
		return "", nil, fmt.Errorf("container URL: %w", err)
	}
	if err := pgserver.WaitReady(ctx, u); err != nil {
		stop(true)
		return "", nil, fmt.Errorf("container does not accept connections: %w", err)
	}
	return u, stop, nil
}

// execAdmin runs one statement on a short-lived connection.
func execAdmin(ctx context.Context, url, sql string) error {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	_, err = conn.Exec(ctx, sql)
	return err
}

// schemaName derives a valid, unique, lowercase schema name from a test name.
func schemaName(testName string) string {
	var b strings.Builder
	b.WriteString("t_")
	for _, r := range strings.ToLower(testName) {
		if b.Len() >= 40 {
			break
		}
		if ('a' <= r && r <= 'z') || ('0' <= r && r <= '9') {
			b.WriteRune(r)
		} else if !strings.HasSuffix(b.String(), "_") {
			b.WriteByte('_')
		}
	}
	var buf [5]byte
	_, _ = rand.Read(buf[:])
	return strings.TrimSuffix(b.String(), "_") + "_" + hex.EncodeToString(buf[:])
}

// withParam sets a run-time parameter in a URL or keyword/value string.
func withParam(conn, key, value string) string {
	if strings.Contains(conn, "://") {
		if u, err := url.Parse(conn); err == nil {
			q := u.Query()
			q.Set(key, value)
			u.RawQuery = q.Encode()
			return u.String()
		}
	}
	return conn + " " + key + "=" + value
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}
