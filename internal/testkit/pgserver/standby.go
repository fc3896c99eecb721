package pgserver

import (
	"bytes"
	"context"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// StandbyOptions configures a streaming standby started by
// [Server.StartStandby].
type StandbyOptions struct {
	// Name is the standby's application_name towards its primary: the name
	// that the primary's synchronous_standby_names lists to make it
	// synchronous. Required.
	Name string
	// Upstream is the host:port the standby streams from, when not the
	// primary's own address: a proxy in between, for cutting replication
	// off. Empty means 127.0.0.1 and the primary's port.
	Upstream string
	// Settings are extra settings of the standby (for instance a custom
	// setting that only the standby has), written like [Options.Settings].
	Settings map[string]string
}

// StartStandby makes a streaming standby of s: pg_basebackup of the
// running server into a fresh temp dir, standby.signal, primary_conninfo
// with opts.Name as application_name, and a free port; then it starts it
// and returns once it accepts (read-only) connections. It keeps s's
// settings (postgresql.conf is copied), except synchronous_standby_names,
// which it clears, so that the standby, once promoted, waits for no
// standby of its own. The caller stops the standby and removes its
// DataDir, as for a server from [StartLocal].
func (s *Server) StartStandby(opts StandbyOptions) (*Server, error) {
	if opts.Name == "" {
		return nil, fmt.Errorf("pgserver: a standby needs a name")
	}
	sb := &Server{binDir: s.binDir, cred: s.cred}
	parent := tempParent(s.cred != nil)
	dir, err := os.MkdirTemp(parent, "pgtest-")
	if err != nil {
		return nil, fmt.Errorf("pgserver: %w", err)
	}
	sb.DataDir = dir
	sb.LogPath = filepath.Join(dir, "pgtest.log")
	fail := func(err error) (*Server, error) {
		_ = os.RemoveAll(dir)
		return nil, err
	}
	if s.cred != nil {
		if err := os.Chown(dir, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			return fail(fmt.Errorf("pgserver: give %s to the postgres user: %w", dir, err))
		}
	}
	if out, err := sb.run("pg_basebackup", "-h", "127.0.0.1", "-p", strconv.Itoa(s.Port), "-U", "postgres",
		"-D", dir, "-X", "stream", "--checkpoint=fast", "--no-sync"); err != nil {
		return fail(fmt.Errorf("pgserver: pg_basebackup: %w\n%s", err, out))
	}
	// The copy has the primary's log and owner file; neither is the
	// standby's.
	for _, name := range []string{filepath.Base(s.LogPath), ownerFile} {
		if err := os.Remove(filepath.Join(dir, name)); err != nil && !os.IsNotExist(err) {
			return fail(fmt.Errorf("pgserver: %w", err))
		}
	}
	upstream := opts.Upstream
	if upstream == "" {
		upstream = fmt.Sprintf("127.0.0.1:%d", s.Port)
	}
	host, port, ok := strings.Cut(upstream, ":")
	if !ok {
		return fail(fmt.Errorf("pgserver: upstream %q is not host:port", upstream))
	}
	settings := map[string]string{
		"primary_conninfo": fmt.Sprintf("host=%s port=%s user=postgres application_name=%s", host, port, opts.Name),
		// Promoted, it must not wait for a standby of its own.
		"synchronous_standby_names": "",
		// Notice a cut-off primary quickly, and reconnect soon.
		"wal_receiver_timeout":        "5s",
		"wal_retrieve_retry_interval": "200ms",
	}
	maps.Copy(settings, opts.Settings)
	// postgresql.auto.conf is read last: the copy's ALTER SYSTEM settings
	// (the primary's synchronous_standby_names above all) must not win.
	var conf bytes.Buffer
	conf.WriteString("# pgtest standby\n")
	for _, k := range slices.Sorted(maps.Keys(settings)) {
		fmt.Fprintf(&conf, "%s = '%s'\n", k, strings.ReplaceAll(settings[k], "'", "''"))
	}
	if err := sb.writeOwned("postgresql.auto.conf", conf.Bytes()); err != nil {
		return fail(err)
	}
	if err := sb.writeOwned("standby.signal", nil); err != nil {
		return fail(err)
	}
	if err := os.WriteFile(filepath.Join(dir, ownerFile), []byte(strconv.Itoa(os.Getpid())), 0o644); err != nil {
		return fail(fmt.Errorf("pgserver: %w", err))
	}
	for attempt := 1; ; attempt++ {
		port, err := freePort()
		if err != nil {
			return fail(err)
		}
		if err := sb.setPort(port); err != nil {
			return fail(err)
		}
		err = sb.Start()
		if err == nil {
			return sb, nil
		}
		if attempt == 3 || !strings.Contains(sb.logTail(), "could not bind") {
			return nil, fmt.Errorf("%w (data dir kept: %s)", err, dir)
		}
	}
}

// writeOwned writes a file into the data directory, owned by the user
// that runs the server.
func (s *Server) writeOwned(name string, b []byte) error {
	path := filepath.Join(s.DataDir, name)
	if err := os.WriteFile(path, b, 0o600); err != nil {
		return fmt.Errorf("pgserver: %w", err)
	}
	if s.cred != nil {
		if err := os.Chown(path, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			return fmt.Errorf("pgserver: %w", err)
		}
	}
	return nil
}

// Promote ends a standby's recovery (pg_ctl promote) and returns once it
// accepts writes.
func (s *Server) Promote() error {
	if out, err := s.run("pg_ctl", "promote", "-D", s.DataDir, "-w", "-t", "60"); err != nil {
		return fmt.Errorf("pgserver: pg_ctl promote: %w\n%s%s", err, out, s.logTail())
	}
	return nil
}

// SetSynchronous sets the server's synchronous_standby_names (ALTER
// SYSTEM, then a reload): names of standbys as their application_name
// gives them, or "" for none.
func (s *Server) SetSynchronous(ctx context.Context, names string) error {
	conn, err := pgx.Connect(ctx, s.URL)
	if err != nil {
		return fmt.Errorf("pgserver: %w", err)
	}
	defer conn.Close(context.Background())
	if _, err := conn.Exec(ctx, "ALTER SYSTEM SET synchronous_standby_names = "+quoteLiteral(names)); err != nil {
		return fmt.Errorf("pgserver: set synchronous_standby_names: %w", err)
	}
	if _, err := conn.Exec(ctx, "SELECT pg_reload_conf()"); err != nil {
		return fmt.Errorf("pgserver: reload: %w", err)
	}
	// The reload is asynchronous: wait until a new session sees the value.
	for {
		var got string
		err := func() error {
			c, err := pgx.Connect(ctx, s.URL)
			if err != nil {
				return err
			}
			defer c.Close(context.Background())
			return c.QueryRow(ctx, "SHOW synchronous_standby_names").Scan(&got)
		}()
		if err != nil {
			return fmt.Errorf("pgserver: %w", err)
		}
		if got == names {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("pgserver: synchronous_standby_names is still %q: %w", got, ctx.Err())
		case <-time.After(pollInterval):
		}
	}
}

// WaitStreaming waits until the standby named name streams from s with
// the given sync_state ("sync", "async", ...) and has replayed everything s
// had written when it was called.
func (s *Server) WaitStreaming(ctx context.Context, name, syncState string) error {
	conn, err := pgx.Connect(ctx, s.URL)
	if err != nil {
		return fmt.Errorf("pgserver: %w", err)
	}
	defer conn.Close(context.Background())
	var target string
	if err := conn.QueryRow(ctx, "SELECT pg_current_wal_lsn()::text").Scan(&target); err != nil {
		return fmt.Errorf("pgserver: %w", err)
	}
	var state, lag string
	for {
		err := conn.QueryRow(ctx, `SELECT coalesce(max(sync_state), ''),
				coalesce(bool_or(replay_lsn >= $2::pg_lsn)::text, 'none')
			FROM pg_stat_replication WHERE application_name = $1 AND state = 'streaming'`,
			name, target).Scan(&state, &lag)
		if err != nil {
			return fmt.Errorf("pgserver: %w", err)
		}
		if state == syncState && lag == "true" {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("pgserver: standby %s: sync_state %q, caught up to %s: %s: %w", name, state, target, lag, ctx.Err())
		case <-time.After(pollInterval):
		}
	}
}

// quoteLiteral quotes s as an SQL string literal.
func quoteLiteral(s string) string {
	return "'" + strings.ReplaceAll(s, "'", "''") + "'"
}
