package pgserver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// Pool modes of PgBouncer.
const (
	PoolSession     = "session"
	PoolTransaction = "transaction"
)

// PgBouncerOptions configures a PgBouncer started by [StartPgBouncer].
type PgBouncerOptions struct {
	// Target is the server PgBouncer connects to, as a URL
	// (postgres://user[:password]@host:port/...). Every database name a
	// client asks for is passed through to it, as user and password
	// when the URL has them.
	Target string
	// PoolMode is [PoolSession] or [PoolTransaction] (the default).
	PoolMode string
	// Settings are extra [pgbouncer] settings, such as
	// {"default_pool_size": "4"}.
	Settings map[string]string
}

// PgBouncer is a PgBouncer process run by this process, on a free port of
// 127.0.0.1, with its configuration in a temp dir.
type PgBouncer struct {
	// Port is the TCP port on 127.0.0.1.
	Port int
	// Dir holds pgbouncer.ini, the user list and the log.
	Dir string
	// LogPath is PgBouncer's log file.
	LogPath string

	bin  string
	cred *syscall.Credential
	user string

	mu   sync.Mutex
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd has been waited for
}

// FindPgBouncer returns the path of the pgbouncer binary (PATH, then
// /usr/sbin/pgbouncer), or "" and why none was found.
func FindPgBouncer() (path, reason string) {
	if p, err := exec.LookPath("pgbouncer"); err == nil {
		return p, ""
	}
	const debian = "/usr/sbin/pgbouncer"
	if fi, err := os.Stat(debian); err == nil && !fi.IsDir() && fi.Mode()&0o111 != 0 {
		return debian, ""
	}
	return "", "no pgbouncer on PATH or at " + debian + " (Debian: apt-get install pgbouncer)"
}

// StartPgBouncer writes a configuration for opts into a fresh temp dir and
// starts PgBouncer (found by [FindPgBouncer]) on a free loopback port, as
// the postgres user when run as root (PgBouncer refuses to run as root).
// Clients authenticate as any user without a password (auth_type trust);
// the admin console (database "pgbouncer") accepts the user "postgres".
// Stop it, then remove Dir, when done.
func StartPgBouncer(opts PgBouncerOptions) (*PgBouncer, error) {
	bin, reason := FindPgBouncer()
	if bin == "" {
		return nil, fmt.Errorf("pgserver: %s", reason)
	}
	target, err := url.Parse(opts.Target)
	if err != nil || target.Hostname() == "" {
		return nil, fmt.Errorf("pgserver: PgBouncer target %q is not a URL with a host", opts.Target)
	}
	b := &PgBouncer{bin: bin, user: target.User.Username()}
	if b.user == "" {
		b.user = "postgres"
	}
	if os.Geteuid() == 0 {
		if b.cred, err = postgresCredential(); err != nil {
			return nil, err
		}
	}
	mode := opts.PoolMode
	if mode == "" {
		mode = PoolTransaction
	}
	dir, err := os.MkdirTemp(tempParent(b.cred != nil), "pgbouncer-")
	if err != nil {
		return nil, fmt.Errorf("pgserver: %w", err)
	}
	b.Dir = dir
	b.LogPath = filepath.Join(dir, "pgbouncer.log")
	fail := func(err error) (*PgBouncer, error) {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if b.cred != nil {
		if err := os.Chown(dir, int(b.cred.Uid), int(b.cred.Gid)); err != nil {
			return fail(fmt.Errorf("pgserver: %w", err))
		}
	}
	port := target.Port()
	if port == "" {
		port = "5432"
	}
	db := fmt.Sprintf("host=%s port=%s", target.Hostname(), port)
	if pw, ok := target.User.Password(); ok {
		db += fmt.Sprintf(" user=%s password=%s", b.user, pw)
	}
	// Users allowed in: anyone may connect with trust, but PgBouncer
	// still wants them listed.
	users := fmt.Sprintf("%q \"\"\n", b.user)
	if b.user != "postgres" {
		users += "\"postgres\" \"\"\n"
	}
	if err := b.write("userlist.txt", []byte(users)); err != nil {
		return fail(err)
	}
	settings := map[string]string{
		"listen_addr":     "127.0.0.1",
		"unix_socket_dir": "",
		"auth_type":       "trust",
		"auth_file":       filepath.Join(dir, "userlist.txt"),
		"admin_users":     "postgres",
		"pool_mode":       mode,
		"logfile":         b.LogPath,
		"max_client_conn": "500",
		// Enough server connections for every pool of a test.
		"default_pool_size": "40",
		// pgx sends no extra startup parameters unless told to; the
		// JDBC-style one is harmless to accept.
		"ignore_startup_parameters": "extra_float_digits",
		"server_login_retry":        "1",
		"log_connections":           "0",
		"log_disconnections":        "0",
	}
	maps.Copy(settings, opts.Settings)
	var ini bytes.Buffer
	fmt.Fprintf(&ini, "[databases]\n* = %s\n\n[pgbouncer]\n", db)
	for _, k := range slices.Sorted(maps.Keys(settings)) {
		if k == "listen_port" {
			continue
		}
		fmt.Fprintf(&ini, "%s = %s\n", k, settings[k])
	}
	for attempt := 1; ; attempt++ {
		p, err := freePort()
		if err != nil {
			return fail(err)
		}
		b.Port = p
		conf := append(bytes.Clone(ini.Bytes()), fmt.Appendf(nil, "listen_port = %d\n", p)...)
		if err := b.write("pgbouncer.ini", conf); err != nil {
			return fail(err)
		}
		err = b.Start()
		if err == nil {
			return b, nil
		}
		if attempt == 3 || !strings.Contains(b.logTail(), "bind") {
			return nil, fmt.Errorf("%w (dir kept: %s)", err, dir)
		}
	}
}

func (b *PgBouncer) write(name string, data []byte) error {
	path := filepath.Join(b.Dir, name)
	if err := os.WriteFile(path, data, 0o600); err != nil {
		return fmt.Errorf("pgserver: %w", err)
	}
	if b.cred != nil {
		if err := os.Chown(path, int(b.cred.Uid), int(b.cred.Gid)); err != nil {
			return fmt.Errorf("pgserver: %w", err)
		}
	}
	return nil
}

// URL connects to database db through PgBouncer, as the target's user.
func (b *PgBouncer) URL(db string) string {
	return fmt.Sprintf("postgres://%s@127.0.0.1:%d/%s?sslmode=disable", url.PathEscape(b.user), b.Port, url.PathEscape(db))
}

// Start starts the stopped PgBouncer again, with the same configuration
// and port, and returns once it accepts connections.
func (b *PgBouncer) Start() error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.cmd != nil {
		return errors.New("pgserver: PgBouncer already running")
	}
	log, err := os.OpenFile(filepath.Join(b.Dir, "pgbouncer.out"), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return fmt.Errorf("pgserver: %w", err)
	}
	defer log.Close()
	cmd := exec.Command(b.bin, filepath.Join(b.Dir, "pgbouncer.ini"))
	cmd.Dir = b.Dir
	cmd.Stdout, cmd.Stderr = log, log
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	dieWithParent(cmd.SysProcAttr)
	if b.cred != nil {
		cmd.SysProcAttr.Credential = b.cred
	}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("pgserver: start pgbouncer: %w", err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		close(done)
	}()
	b.cmd, b.done = cmd, done
	deadline := time.Now().Add(startTimeout)
	for {
		c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", b.Port), time.Second)
		if err == nil {
			c.Close()
			return nil
		}
		select {
		case <-done:
			b.cmd = nil
			return fmt.Errorf("pgserver: pgbouncer exited at start%s", b.logTail())
		case <-time.After(pollInterval):
		}
		if time.Now().After(deadline) {
			b.stopLocked(syscall.SIGKILL)
			return fmt.Errorf("pgserver: pgbouncer does not listen on port %d after %v%s", b.Port, startTimeout, b.logTail())
		}
	}
}

// Kill kills PgBouncer with SIGKILL, as a crash would, and waits for it to
// exit. Killing a stopped PgBouncer does nothing.
func (b *PgBouncer) Kill() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.stopLocked(syscall.SIGKILL)
}

// Stop shuts PgBouncer down at once (SIGINT: close every connection and
// exit) and waits for it to exit. Stopping a stopped PgBouncer does
// nothing.
func (b *PgBouncer) Stop() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.stopLocked(syscall.SIGINT)
}

func (b *PgBouncer) stopLocked(sig syscall.Signal) {
	if b.cmd == nil {
		return
	}
	_ = b.cmd.Process.Signal(sig)
	select {
	case <-b.done:
	case <-time.After(10 * time.Second):
		_ = b.cmd.Process.Kill()
		<-b.done
	}
	b.cmd = nil
}

// Admin runs one command on the admin console (PAUSE, RESUME, RECONNECT,
// SHOW POOLS, ...) and returns its rows as text.
func (b *PgBouncer) Admin(ctx context.Context, command string) ([][]string, error) {
	cfg, err := pgx.ParseConfig(fmt.Sprintf("postgres://postgres@127.0.0.1:%d/pgbouncer?sslmode=disable", b.Port))
	if err != nil {
		return nil, err
	}
	// The console speaks the simple query protocol only.
	cfg.DefaultQueryExecMode = pgx.QueryExecModeSimpleProtocol
	conn, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("pgserver: PgBouncer console: %w", err)
	}
	defer conn.Close(context.Background())
	rr := conn.PgConn().Exec(ctx, command)
	var out [][]string
	for rr.NextResult() {
		res := rr.ResultReader()
		for res.NextRow() {
			var row []string
			for _, v := range res.Values() {
				row = append(row, string(v))
			}
			out = append(out, row)
		}
		if _, err := res.Close(); err != nil {
			return out, fmt.Errorf("pgserver: PgBouncer %s: %w", command, err)
		}
	}
	if err := rr.Close(); err != nil {
		return out, fmt.Errorf("pgserver: PgBouncer %s: %w", command, err)
	}
	return out, nil
}

// logTail returns the end of PgBouncer's log, for error messages.
func (b *PgBouncer) logTail() string {
	var out strings.Builder
	for _, name := range []string{b.LogPath, filepath.Join(b.Dir, "pgbouncer.out")} {
		data, err := os.ReadFile(name)
		if err != nil || len(data) == 0 {
			continue
		}
		const max = 2000
		if len(data) > max {
			data = data[len(data)-max:]
		}
		fmt.Fprintf(&out, "\n--- %s (tail) ---\n%s", name, data)
	}
	return out.String()
}

// Version returns PgBouncer's version line, as pgbouncer --version prints it.
func (b *PgBouncer) Version() string {
	out, err := exec.Command(b.bin, "--version").Output()
	if err != nil {
		return "unknown"
	}
	line, _, _ := strings.Cut(string(out), "\n")
	return strings.TrimSpace(line)
}
