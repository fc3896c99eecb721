// Package pgserver starts throwaway PostgreSQL clusters from the machine's
// own binaries (initdb, pg_ctl) in a temp dir on a free loopback port, as the
// postgres user when run as root (PostgreSQL refuses to run as root). It is
// the part of the test harness (package pgtest) that needs no testing.T, so
// that the benchmarks start their server the same way.
package pgserver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// Options configures a dedicated server started by [NewServer].
type Options struct {
	// Durable keeps PostgreSQL's crash-safety settings (fsync,
	// synchronous_commit, full_page_writes) on. Without it they are off,
	// which is faster but may lose committed data if the machine (not
	// merely the server) crashes.
	Durable bool
	// Settings are extra server settings written to postgresql.conf, such
	// as {"max_connections": "20"}. Values are written as quoted strings.
	Settings map[string]string
}

// Server is a PostgreSQL cluster in a temp dir, run by this process with
// pg_ctl. Stop, Start and Restart keep the same port and data directory.
type Server struct {
	// URL connects as the superuser "postgres" to the database "postgres",
	// without a password.
	URL string
	// LogPath is the server's log file, inside DataDir.
	LogPath string
	// DataDir is the cluster's data directory.
	DataDir string
	// Port is the TCP port on 127.0.0.1.
	Port int

	binDir string
	cred   *syscall.Credential // nil unless we run as root

	mu      sync.Mutex
	running bool
}

// Stop modes for [Server.Stop] and [Server.Restart], as pg_ctl -m takes them.
const (
	// StopSmart waits for clients to disconnect.
	StopSmart = "smart"
	// StopFast disconnects clients, then shuts down cleanly (checkpoint).
	StopFast = "fast"
	// StopImmediate quits without a checkpoint, like a crash: the next start
	// runs crash recovery.
	StopImmediate = "immediate"
)

const (
	startTimeout = 60 * time.Second
	pollInterval = 20 * time.Millisecond
)

// Start starts the stopped server again, on the same port and data directory,
// and returns once it accepts connections. Starting a running server is an
// error.
func (s *Server) Start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.running {
		return errors.New("pgserver: server already running")
	}
	if err := s.start(); err != nil {
		return err
	}
	s.running = true
	return nil
}

// Stop stops the server with a pg_ctl mode: [StopSmart], [StopFast] or
// [StopImmediate]. Stopping a stopped server does nothing.
func (s *Server) Stop(mode string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.running {
		return nil
	}
	switch mode {
	case StopSmart, StopFast, StopImmediate:
	default:
		return fmt.Errorf("pgserver: unknown stop mode %q", mode)
	}
	if out, err := s.run("pg_ctl", "stop", "-D", s.DataDir, "-m", mode, "-w", "-t", "60"); err != nil {
		return fmt.Errorf("pgserver: pg_ctl stop -m %s: %w\n%s%s", mode, err, out, s.logTail())
	}
	s.running = false
	return nil
}

// Restart stops the server with mode (see [Server.Stop]) and starts it again.
func (s *Server) Restart(mode string) error {
	if err := s.Stop(mode); err != nil {
		return err
	}
	return s.Start()
}

// StartLocal creates a cluster (initdb's, see initCluster) in a fresh temp
// dir and starts it.
func StartLocal(binDir string, opts Options) (*Server, error) {
	s := &Server{binDir: binDir}
	if os.Geteuid() == 0 {
		cred, err := postgresCredential()
		if err != nil {
			return nil, err
		}
		s.cred = cred
	}
	parent := tempParent(s.cred != nil)
	s.stopOrphans(parent)
	dir, err := os.MkdirTemp(parent, "pgtest-")
	if err != nil {
		return nil, fmt.Errorf("pgserver: %w", err)
	}
	s.DataDir = dir
	s.LogPath = filepath.Join(dir, "pgtest.log")
	if err := s.initdb(opts); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, ownerFile), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("pgserver: %w", err)
	}
	// Another process may take the free port between our check and the
	// server's bind; try again with a new one a few times.
	for attempt := 1; ; attempt++ {
		port, err := freePort()
		if err != nil {
			_ = os.RemoveAll(dir)
			return nil, err
		}
		if err := s.setPort(port); err != nil {
			_ = os.RemoveAll(dir)
			return nil, err
		}
		err = s.Start()
		if err == nil {
			return s, nil
		}
		if attempt == 3 || !strings.Contains(s.logTail(), "could not bind") {
			// Keep the directory: its log tells what went wrong.
			return nil, fmt.Errorf("%w (data dir kept: %s)", err, dir)
		}
	}
}

// ownerFile, in a data directory, holds the pid of the test binary that
// started the server.
const ownerFile = "pgtest.owner"

// stopOrphans stops servers under parent that were left running by a test
// binary that died without stopping them (a panic or a -timeout ends the
// process before Main or t.Cleanup can run). Their directories are kept:
// their logs tell what happened.
func (s *Server) stopOrphans(parent string) {
	owners, _ := filepath.Glob(filepath.Join(parent, "pgtest-*", ownerFile))
	for _, owner := range owners {
		dir := filepath.Dir(owner)
		b, err := os.ReadFile(owner)
		if err != nil {
			continue
		}
		pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil || pid <= 0 || syscall.Kill(pid, 0) != syscall.ESRCH {
			continue // the owner lives (or we cannot tell)
		}
		if _, err := os.Stat(filepath.Join(dir, "postmaster.pid")); err != nil {
			continue // not running
		}
		orphan := &Server{binDir: s.binDir, cred: s.cred, DataDir: dir}
		if _, err := orphan.run("pg_ctl", "stop", "-D", dir, "-m", StopImmediate, "-w", "-t", "10"); err == nil {
			fmt.Fprintf(os.Stderr, "pgserver: stopped the server in %s, left running by process %d, which is gone\n", dir, pid)
		}
	}
}

// initdb creates the cluster (a copy of initdb's, see initCluster) and
// writes our settings into postgresql.conf, so that pg_ctl start needs no
// options and restarts keep them.
func (s *Server) initdb(opts Options) error {
	if s.cred != nil {
		if err := os.Chown(s.DataDir, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			return fmt.Errorf("pgserver: give %s to the postgres user: %w", s.DataDir, err)
		}
	}
	if err := s.initCluster(filepath.Dir(s.DataDir)); err != nil {
		return err
	}
	settings := map[string]string{
		"listen_addresses": "127.0.0.1",
		// No unix socket: its path would be limited to ~100 bytes, and TCP
		// is what the tests use.
		"unix_socket_directories": "",
		"max_connections":         "200",
		"logging_collector":       "off",
		"log_line_prefix":         "%m [%p] %q%u@%d ",
	}
	if !opts.Durable {
		settings["fsync"] = "off"
		settings["synchronous_commit"] = "off"
		settings["full_page_writes"] = "off"
	}
	maps.Copy(settings, opts.Settings)
	var conf bytes.Buffer
	conf.WriteString("\n# pgtest\n")
	for _, k := range slices.Sorted(maps.Keys(settings)) {
		fmt.Fprintf(&conf, "%s = '%s'\n", k, strings.ReplaceAll(settings[k], "'", "''"))
	}
	return appendFile(filepath.Join(s.DataDir, "postgresql.conf"), conf.Bytes())
}

func (s *Server) setPort(port int) error {
	s.Port = port
	s.URL = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
	// The last setting in the file wins.
	return appendFile(filepath.Join(s.DataDir, "postgresql.conf"), fmt.Appendf(nil, "port = %d\n", port))
}

// start runs pg_ctl start, which waits for the postmaster to report ready
// (and notices when it dies), then polls until a client can connect.
func (s *Server) start() error {
	if out, err := s.run("pg_ctl", "start", "-D", s.DataDir, "-l", s.LogPath,
		"-w", "-t", strconv.Itoa(int(startTimeout/time.Second))); err != nil {
		return fmt.Errorf("pgserver: pg_ctl start: %w\n%s%s", err, out, s.logTail())
	}
	ctx, cancel := context.WithTimeout(context.Background(), startTimeout)
	defer cancel()
	if err := WaitReady(ctx, s.URL); err != nil {
		return fmt.Errorf("pgserver: server started but does not accept connections: %w%s", err, s.logTail())
	}
	return nil
}

// run runs one of the server's programs, as the postgres user when we are root.
func (s *Server) run(name string, args ...string) ([]byte, error) {
	cmd := exec.Command(filepath.Join(s.binDir, name), args...)
	cmd.Env = append(os.Environ(), "LC_ALL=C", "TZ=UTC")
	if s.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred}
		cmd.Dir = s.DataDir // the caller's directory may be closed to postgres
		cmd.Env = append(cmd.Env, "HOME="+s.DataDir, "USER=postgres", "LOGNAME=postgres")
	}
	// pg_ctl start (with -l) points the postmaster's output at the log
	// file, so it does not hold this pipe open; WaitDelay guards anyway.
	cmd.WaitDelay = 5 * time.Second
	return cmd.CombinedOutput()
}

// logTail returns the end of the server log, for error messages.
func (s *Server) logTail() string {
	b, err := os.ReadFile(s.LogPath)
	if err != nil || len(b) == 0 {
		return ""
	}
	const max = 4000
	if len(b) > max {
		b = b[len(b)-max:]
	}
	return fmt.Sprintf("\n--- %s (tail) ---\n%s", s.LogPath, b)
}

// WaitReady polls until url accepts a connection and answers a ping, or ctx ends.
func WaitReady(ctx context.Context, url string) error {
	for {
		err := func() error {
			cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			conn, err := pgx.Connect(cctx, url)
			if err != nil {
				return err
			}
			defer conn.Close(context.Background())
			return conn.Ping(cctx)
		}()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(pollInterval):
		}
	}
}

// FindBinDir returns the directory holding initdb, pg_ctl and postgres, or ""
// and why none was found.
func FindBinDir() (dir, reason string) {
	var reasons []string
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real
		}
		if d := filepath.Dir(p); hasServerBinaries(d) {
			return d, ""
		}
		reasons = append(reasons, "initdb on PATH ("+p+") has no pg_ctl and postgres beside it")
	} else {
		reasons = append(reasons, "no initdb on PATH")
	}
	if out, err := exec.Command("pg_config", "--bindir").Output(); err == nil {
		if d := strings.TrimSpace(string(out)); hasServerBinaries(d) {
			return d, ""
		}
		reasons = append(reasons, "pg_config --bindir has no initdb, pg_ctl and postgres")
	} else {
		reasons = append(reasons, "no pg_config")
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	slices.SortFunc(dirs, func(a, b string) int { return versionOf(b) - versionOf(a) })
	for _, d := range dirs {
		if hasServerBinaries(d) {
			return d, ""
		}
	}
	reasons = append(reasons, "no /usr/lib/postgresql/*/bin with initdb, pg_ctl and postgres")
	return "", strings.Join(reasons, ", ")
}

// versionOf returns the major version in /usr/lib/postgresql/<v>/bin.
func versionOf(binDir string) int {
	v, _ := strconv.Atoi(filepath.Base(filepath.Dir(binDir)))
	return v
}

func hasServerBinaries(dir string) bool {
	for _, name := range []string{"initdb", "pg_ctl", "postgres"} {
		if fi, err := os.Stat(filepath.Join(dir, name)); err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
			return false
		}
	}
	return true
}

// postgresCredential looks up the unprivileged user to run the server as.
func postgresCredential() (*syscall.Credential, error) {
	u, err := user.Lookup("postgres")
	if err != nil {
		return nil, fmt.Errorf("pgserver: running as root, and PostgreSQL refuses to run as root, but there is no postgres user to run it as: %w", err)
	}
	uid, err := strconv.ParseUint(u.Uid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("pgserver: postgres uid %q: %w", u.Uid, err)
	}
	gid, err := strconv.ParseUint(u.Gid, 10, 32)
	if err != nil {
		return nil, fmt.Errorf("pgserver: postgres gid %q: %w", u.Gid, err)
	}
	return &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}, nil
}

// tempParent returns os.TempDir(), or /tmp when the server runs as another
// user who could not reach into os.TempDir() (every ancestor must be
// searchable by others).
func tempParent(otherUser bool) string {
	dir := os.TempDir()
	if !otherUser {
		return dir
	}
	for d := dir; ; d = filepath.Dir(d) {
		fi, err := os.Stat(d)
		if err != nil || fi.Mode().Perm()&0o001 == 0 {
			return "/tmp"
		}
		if d == filepath.Dir(d) {
			return dir
		}
	}
}

// freePort returns a TCP port on 127.0.0.1 that was free a moment ago.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, fmt.Errorf("pgserver: find a free port: %w", err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

func appendFile(path string, b []byte) error {
	f, err := os.OpenFile(path, os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("pgserver: %w", err)
	}
	if _, err := f.Write(b); err != nil {
		f.Close()
		return fmt.Errorf("pgserver: %w", err)
	}
	return f.Close()
}

// Start starts a new cluster with the machine's binaries (see FindBinDir).
// Stop it, then remove its DataDir, when done.
func Start(opts Options) (*Server, error) {
	dir, reason := FindBinDir()
	if dir == "" {
		return nil, fmt.Errorf("pgserver: no PostgreSQL binaries: %s", reason)
	}
	return StartLocal(dir, opts)
}
