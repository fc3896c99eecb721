package pgtest

import (
	"context"
	"database/sql"
	"fmt"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	_ "github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/leakcheck"
)

func TestMain(m *testing.M) {
	os.Exit(leakcheck.Check(Main(m)))
}

func TestNew(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	t.Run("SearchPathIsTheSchema", func(t *testing.T) {
		t.Parallel()
		db := New(t)
		require.True(t, strings.HasPrefix(db.Schema, "t_testnew_searchpathistheschema_"), db.Schema)

		var current, path string
		require.NoError(t, db.Pool.QueryRow(ctx, "SELECT current_schema(), current_setting('search_path')").Scan(&current, &path))
		require.Equal(t, db.Schema, current)
		require.Equal(t, db.Schema, path)

		_, err := db.Pool.Exec(ctx, "CREATE TABLE leases (key text PRIMARY KEY)")
		require.NoError(t, err)
		var schema string
		require.NoError(t, db.Pool.QueryRow(ctx,
			"SELECT table_schema FROM information_schema.tables WHERE table_name = 'leases'").Scan(&schema))
		require.Equal(t, db.Schema, schema)
	})

	t.Run("URLUsesTheSchema", func(t *testing.T) {
		t.Parallel()
		db := New(t)

		conn, err := pgx.Connect(ctx, db.URL)
		require.NoError(t, err)
		defer conn.Close(ctx)
		var current string
		require.NoError(t, conn.QueryRow(ctx, "SELECT current_schema()").Scan(&current))
		require.Equal(t, db.Schema, current)

		sqlDB, err := sql.Open("pgx", db.URL)
		require.NoError(t, err)
		defer sqlDB.Close()
		require.NoError(t, sqlDB.QueryRowContext(ctx, "SELECT current_schema()").Scan(&current))
		require.Equal(t, db.Schema, current)

		admin, err := pgx.Connect(ctx, db.AdminURL)
		require.NoError(t, err)
		defer admin.Close(ctx)
		require.NoError(t, admin.QueryRow(ctx, "SELECT current_schema()").Scan(&current))
		require.Equal(t, "public", current)
	})

	t.Run("TablesAreInvisibleAcrossSchemas", func(t *testing.T) {
		t.Parallel()
		a, b := New(t), New(t)
		require.NotEqual(t, a.Schema, b.Schema)

		_, err := a.Pool.Exec(ctx, "CREATE TABLE only_in_a (id int)")
		require.NoError(t, err)
		var found *string
		require.NoError(t, b.Pool.QueryRow(ctx, "SELECT to_regclass('only_in_a')::text").Scan(&found))
		require.Nil(t, found)
		_, err = b.Pool.Exec(ctx, "SELECT * FROM only_in_a")
		require.ErrorContains(t, err, "does not exist")
		// The same name can be created in b without a clash.
		_, err = b.Pool.Exec(ctx, "CREATE TABLE only_in_a (id int)")
		require.NoError(t, err)
	})
}

// TestNewSchemaPerTest checks that separate tests get separate schemas, and
// that a passing test's schema is dropped.
func TestNewSchemaPerTest(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	var first, second *DB
	t.Run("First", func(t *testing.T) {
		first = New(t)
		_, err := first.Pool.Exec(ctx, "CREATE TABLE made_by_first (id int)")
		require.NoError(t, err)
	})
	t.Run("Second", func(t *testing.T) {
		second = New(t)
		var found *string
		require.NoError(t, second.Pool.QueryRow(ctx, "SELECT to_regclass('made_by_first')::text").Scan(&found))
		require.Nil(t, found)
	})
	require.NotNil(t, first)
	require.NotNil(t, second)
	require.NotEqual(t, first.Schema, second.Schema)

	admin, err := pgx.Connect(ctx, first.AdminURL)
	require.NoError(t, err)
	defer admin.Close(ctx)
	var n int
	require.NoError(t, admin.QueryRow(ctx,
		"SELECT count(*) FROM pg_namespace WHERE nspname IN ($1, $2)", first.Schema, second.Schema).Scan(&n))
	require.Zero(t, n, "schemas of passing tests are dropped")
}

func TestNewServer(t *testing.T) {
	t.Parallel()
	ctx := context.Background()

	s := NewServer(t, ServerOptions{Durable: true, Settings: map[string]string{"max_connections": "20"}})
	port := s.Port

	conn, err := pgx.Connect(ctx, s.URL)
	require.NoError(t, err)
	var fsync, maxConns string
	require.NoError(t, conn.QueryRow(ctx, "SELECT current_setting('fsync'), current_setting('max_connections')").Scan(&fsync, &maxConns))
	require.Equal(t, "on", fsync)
	require.Equal(t, "20", maxConns)
	_, err = conn.Exec(ctx, "CREATE TABLE kept (id int); INSERT INTO kept VALUES (1)")
	require.NoError(t, err)
	require.NoError(t, conn.Close(ctx))

	if os.Geteuid() == 0 {
		requireRunsAsPostgres(t, s)
	}

	count := func() int {
		t.Helper()
		conn, err := pgx.Connect(ctx, s.URL)
		require.NoError(t, err)
		defer conn.Close(ctx)
		var n int
		require.NoError(t, conn.QueryRow(ctx, "SELECT count(*) FROM kept").Scan(&n))
		return n
	}

	begin := time.Now()
	require.NoError(t, s.Restart(StopFast))
	t.Logf("fast restart took %v", time.Since(begin).Round(time.Millisecond))
	require.Equal(t, port, s.Port)
	require.Equal(t, 1, count(), "a fast restart keeps committed rows")

	begin = time.Now()
	require.NoError(t, s.Restart(StopImmediate))
	t.Logf("immediate restart (crash recovery) took %v", time.Since(begin).Round(time.Millisecond))
	require.Equal(t, 1, count(), "crash recovery keeps committed rows")
	log, err := os.ReadFile(s.LogPath)
	require.NoError(t, err)
	require.Contains(t, string(log), "database system was interrupted", "the immediate stop needed recovery")

	require.NoError(t, s.Stop(StopImmediate))
	_, err = pgx.Connect(ctx, s.URL)
	require.Error(t, err, "stopped server refuses connections")
	require.NoError(t, s.Stop(StopImmediate), "stopping twice is harmless")
	require.NoError(t, s.Start())
	require.Error(t, s.Start(), "starting twice is an error")
	require.Equal(t, 1, count())
}

// requireRunsAsPostgres checks the privilege drop: the postmaster runs as the
// postgres user, not as root.
func requireRunsAsPostgres(t *testing.T, s *Server) {
	t.Helper()
	u, err := user.Lookup("postgres")
	require.NoError(t, err)
	pidFile, err := os.ReadFile(filepath.Join(s.DataDir, "postmaster.pid"))
	require.NoError(t, err)
	pid, _, _ := strings.Cut(string(pidFile), "\n")
	status, err := os.ReadFile("/proc/" + strings.TrimSpace(pid) + "/status")
	require.NoError(t, err)
	var uidLine string
	for line := range strings.Lines(string(status)) {
		if strings.HasPrefix(line, "Uid:") {
			uidLine = line
		}
	}
	fields := strings.Fields(uidLine)
	require.Len(t, fields, 5, uidLine)
	for _, id := range fields[1:] { // real, effective, saved, filesystem
		require.Equal(t, u.Uid, id, uidLine)
	}
	fi, err := os.Stat(s.DataDir)
	require.NoError(t, err)
	require.Equal(t, u.Uid, strconv.Itoa(int(fi.Sys().(*syscall.Stat_t).Uid)), "the data dir belongs to postgres")
}

func TestDockerDetectionIsFast(t *testing.T) {
	t.Parallel()
	begin := time.Now()
	err := dockerReachable()
	elapsed := time.Since(begin)
	if err == nil {
		t.Skipf("a Docker engine answers (in %v); nothing to measure", elapsed)
	}
	t.Logf("no Docker engine, found out in %v: %v", elapsed, err)
	require.Less(t, elapsed, 3*time.Second)
}

func TestURLForLog(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ in, want string }{
		{"postgres://u:secret@h:5432/db?sslmode=disable", "postgres://u:xxxxx@h:5432/db?sslmode=disable"},
		{"postgres://u@h/db", "postgres://u@h/db"},
		{"postgresql://u@h/db?password=secret&search_path=s", "postgresql://u@h/db?password=xxxxx&search_path=s"},
		{"host=h user=u password=secret dbname=d", "host=h user=u password=xxxxx dbname=d"},
		{"host=h password = 'se cret' dbname=d", "host=h password = xxxxx dbname=d"},
		{"host=h dbname=d", "host=h dbname=d"},
	} {
		got := URLForLog(tc.in)
		require.Equal(t, tc.want, got, tc.in)
		require.NotContains(t, got, "secret")
	}
}

func TestSchemaName(t *testing.T) {
	t.Parallel()
	name := schemaName("TestX/Some Sub-test_with_a_very_long_name_that_goes_on_and_on")
	require.Regexp(t, `^t_testx_some_sub_test_with_a_very_long_n_[0-9a-f]{10}$`, name)
	require.LessOrEqual(t, len(name), 63)
	require.NotEqual(t, name, schemaName("TestX/Some Sub-test_with_a_very_long_name_that_goes_on_and_on"))
}

// fakeTB records Skipf and Fatalf instead of ending the test.
type fakeTB struct {
	testing.TB
	skipped, failed string
}

func (f *fakeTB) Skipf(format string, args ...any)  { f.skipped = fmt.Sprintf(format, args...) }
func (f *fakeTB) Fatalf(format string, args ...any) { f.failed = fmt.Sprintf(format, args...) }

func TestUnavailable(t *testing.T) {
	t.Run("Skips", func(t *testing.T) {
		t.Setenv(EnvRequire, "")
		f := &fakeTB{TB: t}
		unavailable(f, "no initdb on PATH")
		require.Contains(t, f.skipped, "no initdb on PATH")
		require.Empty(t, f.failed)
	})
	t.Run("FailsWhenRequired", func(t *testing.T) {
		t.Setenv(EnvRequire, "1")
		f := &fakeTB{TB: t}
		unavailable(f, "no initdb on PATH")
		require.Contains(t, f.failed, "no initdb on PATH")
		require.Empty(t, f.skipped)
	})
}
