package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// pgServer is a throwaway PostgreSQL cluster in a temp dir, with the
// server's default durable settings (fsync, synchronous_commit and
// full_page_writes on). Bench is its own module, so this is a small copy of
// what internal/testkit/pgtest does.
type pgServer struct {
	url, dataDir, binDir, logPath string
	cred                          *syscall.Credential
}

func findPGBin() (string, error) {
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			p = real
		}
		if hasPGBinaries(filepath.Dir(p)) {
			return filepath.Dir(p), nil
		}
	}
	dirs, _ := filepath.Glob("/usr/lib/postgresql/*/bin")
	slices.SortFunc(dirs, func(a, b string) int {
		va, _ := strconv.Atoi(filepath.Base(filepath.Dir(a)))
		vb, _ := strconv.Atoi(filepath.Base(filepath.Dir(b)))
		return vb - va
	})
	for _, d := range dirs {
		if hasPGBinaries(d) {
			return d, nil
		}
	}
	return "", errors.New("no initdb/pg_ctl/postgres found (on PATH or in /usr/lib/postgresql/*/bin); install PostgreSQL or pass -database-url")
}

func hasPGBinaries(dir string) bool {
	for _, n := range []string{"initdb", "pg_ctl", "postgres"} {
		if fi, err := os.Stat(filepath.Join(dir, n)); err != nil || fi.IsDir() {
			return false
		}
	}
	return true
}

func startPG(ctx context.Context, logf func(string, ...any)) (*pgServer, error) {
	bin, err := findPGBin()
	if err != nil {
		return nil, err
	}
	s := &pgServer{binDir: bin}
	parent := os.TempDir()
	if os.Geteuid() == 0 {
		// PostgreSQL refuses to run as root: run it as "postgres".
		u, err := user.Lookup("postgres")
		if err != nil {
			return nil, fmt.Errorf("running as root and there is no postgres user to run the server as: %w", err)
		}
		uid, _ := strconv.ParseUint(u.Uid, 10, 32)
		gid, _ := strconv.ParseUint(u.Gid, 10, 32)
		s.cred = &syscall.Credential{Uid: uint32(uid), Gid: uint32(gid)}
		parent = "/tmp"
	}
	dir, err := os.MkdirTemp(parent, "ashlock-bench-pg-")
	if err != nil {
		return nil, err
	}
	s.dataDir = dir
	s.logPath = filepath.Join(dir, "server.log")
	if s.cred != nil {
		if err := os.Chown(dir, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			s.remove()
			return nil, err
		}
	}
	if out, err := s.run("initdb", "-D", dir, "--auth=trust", "-U", "postgres", "--no-locale", "--encoding=UTF8", "--no-instructions"); err != nil {
		s.remove()
		return nil, fmt.Errorf("initdb: %w\n%s", err, out)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		s.remove()
		return nil, err
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	// Only what a test server needs; durability settings stay at their
	// defaults (fsync, synchronous_commit, full_page_writes on).
	conf := fmt.Sprintf("\n# ashlock bench\nlisten_addresses = '127.0.0.1'\nport = %d\nunix_socket_directories = ''\nmax_connections = 300\nlogging_collector = off\n", port)
	f, err := os.OpenFile(filepath.Join(dir, "postgresql.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err == nil {
		_, err = f.WriteString(conf)
		if cerr := f.Close(); err == nil {
			err = cerr
		}
	}
	if err != nil {
		s.remove()
		return nil, err
	}
	if out, err := s.run("pg_ctl", "start", "-D", dir, "-l", s.logPath, "-w", "-t", "60"); err != nil {
		s.remove()
		return nil, fmt.Errorf("pg_ctl start: %w\n%s", err, out)
	}
	s.url = fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", port)
	deadline := time.Now().Add(30 * time.Second)
	for {
		c, err := pgx.Connect(ctx, s.url)
		if err == nil {
			c.Close(ctx)
			break
		}
		if time.Now().After(deadline) {
			s.stop()
			return nil, fmt.Errorf("server does not accept connections: %w", err)
		}
		time.Sleep(50 * time.Millisecond)
	}
	logf("started PostgreSQL from %s in %s (port %d)", bin, dir, port)
	return s, nil
}

func (s *pgServer) run(name string, args ...string) ([]byte, error) {
	cmd := exec.Command(filepath.Join(s.binDir, name), args...)
	cmd.Env = append(os.Environ(), "LC_ALL=C", "TZ=UTC")
	if s.cred != nil {
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: s.cred}
		cmd.Dir = s.dataDir
		cmd.Env = append(cmd.Env, "HOME="+s.dataDir, "USER=postgres", "LOGNAME=postgres")
	}
	cmd.WaitDelay = 5 * time.Second
	return cmd.CombinedOutput()
}

// stop shuts the server down and removes its directory.
func (s *pgServer) stop() {
	if out, err := s.run("pg_ctl", "stop", "-D", s.dataDir, "-m", "fast", "-w", "-t", "60"); err != nil {
		fmt.Fprintf(os.Stderr, "bench: pg_ctl stop: %v\n%s", err, strings.TrimSpace(string(out)))
		return // keep the directory: its log says why
	}
	s.remove()
}

func (s *pgServer) remove() { _ = os.RemoveAll(s.dataDir) }
