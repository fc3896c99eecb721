package pgtest

import (
	"testing"
	"time"

	"github.com/ashlock/ashlock/internal/testkit/pgserver"
)

// ServerOptions configures a dedicated server started by [NewServer].
type ServerOptions = pgserver.Options

// Server is a PostgreSQL cluster in a temp dir, run by this process with
// pg_ctl (see package pgserver).
type Server = pgserver.Server

// Stop modes for [Server.Stop] and [Server.Restart].
const (
	StopSmart     = pgserver.StopSmart
	StopFast      = pgserver.StopFast
	StopImmediate = pgserver.StopImmediate
)

// NewServer starts a dedicated server for a test that stops, restarts or
// crashes it; it is never the shared one. It needs initdb and pg_ctl on this
// machine (see the package doc): without them the test is skipped, or fails
// when SQLLOCK_REQUIRE_POSTGRES=1. The server is stopped (immediate) and its
// directory removed in t.Cleanup; when the test failed, the directory is kept
// and the log's path is logged.
func NewServer(t testing.TB, opts ServerOptions) *Server {
	t.Helper()
	binDir, reason := pgserver.FindBinDir()
	if binDir == "" {
		unavailable(t, "NewServer needs initdb and pg_ctl: "+reason)
	}
	begin := time.Now()
	s, err := pgserver.StartLocal(binDir, opts)
	if err != nil {
		t.Fatalf("pgtest: %v", err)
	}
	t.Logf("pgtest: dedicated server %s from %s started in %v; log %s",
		s.URL, binDir, time.Since(begin).Round(time.Millisecond), s.LogPath)
	cleanupServer(t, s)
	return s
}
