package pgtest

import (
	"context"
	"fmt"
	"net/url"
	"os"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ashlock/ashlock/internal/testkit/pgserver"
)

// EnvRequirePgBouncer, set to 1, turns "no pgbouncer binary" from a skip
// into a failure (CI sets it, and installs PgBouncer).
const EnvRequirePgBouncer = "SQLLOCK_REQUIRE_PGBOUNCER"

// Pool modes of PgBouncer, for [NewPgBouncer].
const (
	PoolSession     = pgserver.PoolSession
	PoolTransaction = pgserver.PoolTransaction
)

// StandbyOptions configures a standby started by [NewStandby].
type StandbyOptions = pgserver.StandbyOptions

// NewStandby starts a streaming standby of primary (a server from
// [NewServer]; see [pgserver.Server.StartStandby]). It is stopped
// (immediate) and its directory removed in t.Cleanup, or kept with its log
// when the test failed.
func NewStandby(t testing.TB, primary *Server, opts StandbyOptions) *Server {
	t.Helper()
	begin := time.Now()
	s, err := primary.StartStandby(opts)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Logf("pgtest: standby %s of port %d started in %v; log %s",
		s.URL, primary.Port, time.Since(begin).Round(time.Millisecond), s.LogPath)
	cleanupServer(t, s)
	return s
}

// cleanupServer stops s and removes its directory at the end of the test,
// keeping it when the test failed.
func cleanupServer(t testing.TB, s *Server) {
	t.Cleanup(func() {
		if err := s.Stop(StopImmediate); err != nil {
			t.Errorf("pgtest: stop server: %v", err)
		}
		if t.Failed() {
			t.Logf("pgtest: kept %s; server log: %s", s.DataDir, s.LogPath)
			return
		}
		if err := os.RemoveAll(s.DataDir); err != nil {
			t.Errorf("pgtest: remove %s: %v", s.DataDir, err)
		}
	})
}

// Bouncer is a PgBouncer in front of a fresh database of the shared server.
type Bouncer struct {
	*pgserver.PgBouncer
	// Database is the fresh database's name.
	Database string
	// URL connects to Database through PgBouncer. It has no search_path
	// (PgBouncer 1.18 refuses startup parameters it does not know): the
	// database is fresh, so its public schema is the test's own.
	URL string
	// DirectURL connects to Database without PgBouncer.
	DirectURL string
}

// NewPgBouncer creates a fresh database on the shared server and starts
// PgBouncer in front of it, in poolMode ([PoolSession] or
// [PoolTransaction]). Without a pgbouncer binary (or without a PostgreSQL)
// the test is skipped, or fails when SQLLOCK_REQUIRE_PGBOUNCER=1 (or
// SQLLOCK_REQUIRE_POSTGRES=1). At the end of the test PgBouncer is
// stopped and the database dropped; when the test failed, PgBouncer's
// directory (with its log) and the database are kept.
func NewPgBouncer(t testing.TB, poolMode string, settings map[string]string) *Bouncer {
	t.Helper()
	if _, reason := pgserver.FindPgBouncer(); reason != "" {
		if os.Getenv(EnvRequirePgBouncer) == "1" {
			t.Fatalf("pgtest: %s=1: %s", EnvRequirePgBouncer, reason)
		}
		t.Skipf("pgtest: %s (set %s=1 to fail instead)", reason, EnvRequirePgBouncer)
	}
	adminURL, source := sharedServer(t)
	name := schemaName(t.Name())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	direct := createDatabase(t, ctx, adminURL, name)
	b, err := pgserver.StartPgBouncer(pgserver.PgBouncerOptions{Target: adminURL, PoolMode: poolMode, Settings: settings})
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Logf("pgtest: %s (pool_mode %s) on port %d in front of database %s on %s; log %s",
		b.Version(), poolMode, b.Port, name, source, b.LogPath)
	t.Cleanup(func() {
		b.Stop()
		if t.Failed() {
			t.Logf("pgtest: kept %s and database %s: %s", b.Dir, name, URLForLog(direct))
			return
		}
		_ = os.RemoveAll(b.Dir)
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		if err := execAdmin(ctx, adminURL, "DROP DATABASE "+pgx.Identifier{name}.Sanitize()+" WITH (FORCE)"); err != nil {
			t.Errorf("pgtest: drop database %s: %v", name, err)
		}
	})
	return &Bouncer{PgBouncer: b, Database: name, URL: b.URL(name), DirectURL: direct}
}

// withDatabase returns the URL u with its database replaced by name.
func withDatabase(u, name string) (string, error) {
	p, err := url.Parse(u)
	if err != nil || p.Scheme == "" {
		return "", fmt.Errorf("the shared server's URL %s is not a URL", URLForLog(u))
	}
	p.Path = "/" + name
	return p.String(), nil
}
