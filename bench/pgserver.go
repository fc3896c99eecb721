package main

import (
	"fmt"
	"os"
	"time"

	"github.com/ashlock/ashlock/internal/testkit/pgserver"
)

// startPG starts a throwaway PostgreSQL cluster the way the tests do
// (package pgserver: the machine's binaries, a temp dir, a free loopback
// port, the postgres user when run as root), with the server's default
// durable settings (fsync, synchronous_commit and full_page_writes on).
func startPG(logf func(string, ...any)) (*pgserver.Server, error) {
	begin := time.Now()
	srv, err := pgserver.Start(pgserver.Options{Durable: true, Settings: map[string]string{"max_connections": "300"}})
	if err != nil {
		return nil, fmt.Errorf("start PostgreSQL (or pass -database-url): %w", err)
	}
	logf("started PostgreSQL in %s (port %d) in %v", srv.DataDir, srv.Port, time.Since(begin).Round(time.Millisecond))
	return srv, nil
}

// stopPG shuts the server down and removes its directory, or keeps the
// directory when the server would not stop: its log says why.
func stopPG(srv *pgserver.Server) {
	if err := srv.Stop(pgserver.StopFast); err != nil {
		fmt.Fprintf(os.Stderr, "bench: %v (kept %s)\n", err, srv.DataDir)
		return
	}
	_ = os.RemoveAll(srv.DataDir)
}
