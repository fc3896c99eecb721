// Package pgtest finds or starts a real PostgreSQL server for tests.
//
// The server comes from the first source that works, in this order:
//
//  0. SQLLOCK_POSTGRES_URL, when set, is used as it is.
//  1. testcontainers-go (postgres:17-alpine), when a Docker engine answers a
//     ping within 2 s.
//  2. initdb and pg_ctl found on PATH, through pg_config --bindir, or in
//     /usr/lib/postgresql/*/bin (newest first): a throwaway cluster in a temp
//     dir on a free loopback port. As root, the server runs as the
//     unprivileged "postgres" user, since PostgreSQL refuses to run as root.
//  3. Otherwise the test is skipped, with every reason collected; with
//     SQLLOCK_REQUIRE_POSTGRES=1 (as in CI) it fails instead, so that CI can
//     never pass by skipping.
//
// One server is shared by all tests of a test binary: it is started on the
// first call to [New] and stopped by [Main], which wraps the package's
// TestMain. Each test gets its own schema on it. Tests that stop, restart or
// crash the server use [NewServer], which always starts a dedicated one.
package pgtest
