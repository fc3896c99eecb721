// Package mariaserver starts throwaway MariaDB servers from the machine's
// own binaries (mariadb-install-db, mariadbd) in a temp dir on a free
// loopback port, with small buffers so that one starts in a few seconds.
// It needs no database driver: the tests' harness with the driver is
// internal/testkit/mariatest.
//
// Run as root, the server runs as root too (mariadbd --user=root): the
// data directory is the test's own, in a temp dir, and no other user needs
// to read it.
package mariaserver

import (
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// Options configures a server started by [Start].
type Options struct {
	// Durable keeps every commit on disk before its reply
	// (innodb_flush_log_at_trx_commit=1, sync_binlog does not apply: no
	// binary log). Without it commits are written at each second, which is
	// faster and enough for tests that never crash the server.
	Durable bool
	// Args are extra mariadbd options, such as "--max-connections=50".
	Args []string
}

// Server is one mariadbd in a temp dir, run by this process. Kill and
// Start keep the same port and data directory.
type Server struct {
	// Addr is host:port on 127.0.0.1; the user is root, without a password.
	Addr string
	// Dir holds the data directory, the socket and the error log.
	Dir string

	bin, installDB string
	args           []string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{}
}

// FindBinaries returns the paths of mariadbd and mariadb-install-db: on
// PATH, else where Debian's mariadb-server puts them.
func FindBinaries() (mariadbd, installDB string, err error) {
	find := func(name string, dirs ...string) string {
		if p, err := exec.LookPath(name); err == nil {
			return p
		}
		for _, d := range dirs {
			if p := filepath.Join(d, name); isExec(p) {
				return p
			}
		}
		return ""
	}
	mariadbd = find("mariadbd", "/usr/sbin", "/usr/local/sbin", "/usr/local/mysql/bin")
	installDB = find("mariadb-install-db", "/usr/bin", "/usr/local/bin", "/usr/local/mysql/scripts")
	if mariadbd == "" || installDB == "" {
		return "", "", errors.New("mariaserver: no mariadbd and mariadb-install-db found (install Debian's mariadb-server)")
	}
	return mariadbd, installDB, nil
}

func isExec(p string) bool {
	st, err := os.Stat(p)
	return err == nil && !st.IsDir() && st.Mode()&0o111 != 0
}

// Start creates a data directory with mariadb-install-db in a fresh temp
// dir and starts mariadbd on a free loopback port; it returns once the
// server accepts connections.
func Start(opts Options) (*Server, error) {
	bin, installDB, err := FindBinaries()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp("", "mariatest-")
	if err != nil {
		return nil, fmt.Errorf("mariaserver: %w", err)
	}
	s := &Server{Dir: dir, bin: bin, installDB: installDB}
	// A temp dir of the server's own: concurrent mariadb-install-db runs
	// sharing one failed now and then (ERROR 1051: Unknown table
	// 'mysql.tmp_user_sys').
	tmp := filepath.Join(dir, "tmp")
	if err := os.Mkdir(tmp, 0o700); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("mariaserver: %w", err)
	}
	cmd := exec.Command(installDB, "--no-defaults", "--datadir="+s.dataDir(), "--tmpdir="+tmp,
		"--auth-root-authentication-method=normal", "--skip-test-db", "--user="+runAs())
	cmd.Env = cleanEnv()
	if out, err := cmd.CombinedOutput(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("mariaserver: mariadb-install-db: %w\n%s", err, out)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		_ = os.RemoveAll(dir)
		return nil, fmt.Errorf("mariaserver: %w", err)
	}
	port := l.Addr().(*net.TCPAddr).Port
	l.Close()
	s.Addr = net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	flush := "2"
	if opts.Durable {
		flush = "1"
	}
	s.args = append([]string{
		"--no-defaults",
		"--datadir=" + s.dataDir(),
		"--tmpdir=" + tmp,
		"--user=" + runAs(),
		"--bind-address=127.0.0.1",
		"--port=" + strconv.Itoa(port),
		"--socket=" + filepath.Join(dir, "mariadbd.sock"),
		"--pid-file=" + filepath.Join(dir, "mariadbd.pid"),
		"--log-error=" + s.LogPath(),
		"--skip-name-resolve",
		"--skip-log-bin",
		"--innodb-buffer-pool-size=32M",
		"--innodb-log-file-size=32M",
		"--innodb-flush-log-at-trx-commit=" + flush,
		"--max-connections=300",
		"--performance-schema=OFF",
	}, opts.Args...)
	if err := s.Start(); err != nil {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	return s, nil
}

// runAs is the user mariadbd runs as: root when we are root (the data
// directory is ours), else the current user (the option is then ignored).
func runAs() string {
	if os.Geteuid() == 0 {
		return "root"
	}
	if u := os.Getenv("USER"); u != "" {
		return u
	}
	return strconv.Itoa(os.Geteuid())
}

func (s *Server) dataDir() string { return filepath.Join(s.Dir, "data") }

// LogPath is the server's error log.
func (s *Server) LogPath() string { return filepath.Join(s.Dir, "mariadbd.err") }

// Start starts the stopped server again on the same port and data
// directory (crash recovery runs after a Kill) and returns once it
// accepts connections.
func (s *Server) Start() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd != nil {
		return errors.New("mariaserver: already running")
	}
	cmd := exec.Command(s.bin, s.args...)
	cmd.Env = cleanEnv()
	// The server dies with the test binary, whatever happens to it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("mariaserver: start mariadbd: %w", err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	s.cmd, s.done = cmd, done
	deadline := time.Now().Add(60 * time.Second)
	for {
		select {
		case <-done:
			s.cmd, s.done = nil, nil
			return fmt.Errorf("mariaserver: mariadbd exited at start\n%s", s.LogTail())
		default:
		}
		if s.accepting() {
			return nil
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			<-done
			s.cmd, s.done = nil, nil
			return fmt.Errorf("mariaserver: mariadbd not ready after 60s\n%s", s.LogTail())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// accepting reports whether the server sent its handshake on a new
// connection: the listener exists and the server is past recovery.
func (s *Server) accepting() bool {
	c, err := net.DialTimeout("tcp", s.Addr, time.Second)
	if err != nil {
		return false
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(2 * time.Second))
	var b [5]byte
	n, _ := c.Read(b[:])
	// A handshake packet: 3 bytes of length, sequence 0, protocol 10. An
	// error packet (0xff) means "not yet".
	return n == 5 && b[4] == 10
}

// Kill sends SIGKILL to mariadbd, as a crash would, and waits for it to
// exit. Killing a stopped server does nothing.
func (s *Server) Kill() error { return s.signal(syscall.SIGKILL) }

// Stop shuts mariadbd down cleanly (SIGTERM) and waits for it to exit.
func (s *Server) Stop() error { return s.signal(syscall.SIGTERM) }

func (s *Server) signal(sig syscall.Signal) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.cmd == nil {
		return nil
	}
	_ = s.cmd.Process.Signal(sig)
	select {
	case <-s.done:
	case <-time.After(60 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.done
	}
	s.cmd, s.done = nil, nil
	return nil
}

// Close kills the server and removes its directory unless keep.
func (s *Server) Close(keep bool) {
	_ = s.Kill()
	if !keep {
		_ = os.RemoveAll(s.Dir)
	}
}

// LogTail is the end of the error log, for a failure message.
func (s *Server) LogTail() string {
	data, _ := os.ReadFile(s.LogPath())
	if len(data) > 4000 {
		data = data[len(data)-4000:]
	}
	return string(data)
}

// cleanEnv is the environment without MYSQL_* and MARIADB_* variables,
// which the server and its scripts read.
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "MYSQL_") && !strings.HasPrefix(kv, "MARIADB_") {
			env = append(env, kv)
		}
	}
	return env
}
