// Package etcdserver starts throwaway etcd clusters of one or more members
// from the etcd binary on the machine (Debian's etcd-server package), on
// free loopback ports in a temporary directory, and kills, stops and
// restarts their members: for the etcd backend's tests (through its
// etcdtest package) and the benchmarks. It uses the standard library only
// (etcd's HTTP gateway for status), so the root module does not depend on
// etcd's client.
package etcdserver

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"
)

// EnvBin names an etcd binary to use instead of looking for one.
const EnvBin = "SQLLOCK_ETCD_BIN"

// FindBinary returns the etcd server binary: $SQLLOCK_ETCD_BIN, else etcd
// on PATH, else /usr/bin/etcd or /usr/local/bin/etcd (Debian's etcd-server
// package installs /usr/bin/etcd).
func FindBinary() (string, error) {
	if p := os.Getenv(EnvBin); p != "" {
		if _, err := os.Stat(p); err != nil {
			return "", fmt.Errorf("%s=%s: %w", EnvBin, p, err)
		}
		return p, nil
	}
	if p, err := exec.LookPath("etcd"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/bin/etcd", "/usr/local/bin/etcd"} {
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", errors.New("no etcd binary (install Debian's etcd-server, or set " + EnvBin + ")")
}

// Options configure a [Cluster].
type Options struct {
	// Members is the cluster size (default 1).
	Members int
	// Dir is where the members' data directories and logs go (default a
	// new temporary directory, removed by Close unless Keep).
	Dir string
	// HeartbeatMS and ElectionMS are etcd's --heartbeat-interval and
	// --election-timeout (defaults 100 and 1000, etcd's own).
	HeartbeatMS, ElectionMS int
	// Keep keeps Dir after Close (for a failed test's logs).
	Keep bool
}

// Member is one etcd server process of a Cluster.
type Member struct {
	Name      string
	ClientURL string
	PeerURL   string
	dir       string
	logPath   string

	mu   sync.Mutex // guards cmd, done
	cmd  *exec.Cmd
	done chan struct{} // closed when cmd has exited
}

// Cluster is a set of etcd members on loopback, started by [Start].
type Cluster struct {
	Members []*Member
	bin     string
	dir     string
	keep    bool
	args    []string // shared flags
}

// Start starts a cluster of opts.Members members on free loopback ports and
// waits until it has a leader and answers. Close it when done.
func Start(ctx context.Context, opts Options) (*Cluster, error) {
	bin, err := FindBinary()
	if err != nil {
		return nil, err
	}
	n := max(opts.Members, 1)
	dir := opts.Dir
	if dir == "" {
		if dir, err = os.MkdirTemp("", "sqllock-etcd-"); err != nil {
			return nil, err
		}
	}
	c := &Cluster{bin: bin, dir: dir, keep: opts.Keep}
	ports, err := freePorts(2 * n)
	if err != nil {
		return nil, err
	}
	var initial []string
	for i := range n {
		m := &Member{
			Name:      fmt.Sprintf("m%d", i),
			ClientURL: fmt.Sprintf("http://127.0.0.1:%d", ports[2*i]),
			PeerURL:   fmt.Sprintf("http://127.0.0.1:%d", ports[2*i+1]),
		}
		m.dir = filepath.Join(dir, m.Name)
		m.logPath = filepath.Join(dir, m.Name+".log")
		c.Members = append(c.Members, m)
		initial = append(initial, m.Name+"="+m.PeerURL)
	}
	c.args = []string{
		"--initial-cluster", strings.Join(initial, ","),
		"--initial-cluster-state", "new",
		"--initial-cluster-token", filepath.Base(dir),
		"--heartbeat-interval", fmt.Sprint(cmpOr(opts.HeartbeatMS, 100)),
		"--election-timeout", fmt.Sprint(cmpOr(opts.ElectionMS, 1000)),
		"--logger", "zap", "--log-outputs", "stderr", "--log-level", "warn",
	}
	for i := range c.Members {
		if err := c.Start(i); err != nil {
			c.Close()
			return nil, err
		}
	}
	if err := c.WaitReady(ctx); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

func cmpOr(v, d int) int {
	if v == 0 {
		return d
	}
	return v
}

// freePorts returns n distinct loopback ports that were free a moment ago.
func freePorts(n int) ([]int, error) {
	var ls []net.Listener
	defer func() {
		for _, l := range ls {
			l.Close()
		}
	}()
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ls = append(ls, l)
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// Bin is the etcd binary the members run.
func (c *Cluster) Bin() string { return c.bin }

// KeepDir makes Close keep the directory (for a failed run's logs).
func (c *Cluster) KeepDir() { c.keep = true }

// Dir is the cluster's directory: a data directory and a log per member.
func (c *Cluster) Dir() string { return c.dir }

// Endpoints are the members' client URLs.
func (c *Cluster) Endpoints() []string {
	var eps []string
	for _, m := range c.Members {
		eps = append(eps, m.ClientURL)
	}
	return eps
}

// Start starts member i (again): its data directory, if any, is reused,
// so a restarted member rejoins with its log.
func (c *Cluster) Start(i int) error {
	m := c.Members[i]
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cmd != nil {
		return fmt.Errorf("etcdserver: %s is running", m.Name)
	}
	logf, err := os.OpenFile(m.logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	args := append([]string{
		"--name", m.Name, "--data-dir", m.dir,
		"--listen-client-urls", m.ClientURL, "--advertise-client-urls", m.ClientURL,
		"--listen-peer-urls", m.PeerURL, "--initial-advertise-peer-urls", m.PeerURL,
	}, c.args...)
	cmd := exec.Command(c.bin, args...)
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.Env = cleanEnv()
	// The member dies with the test binary, whatever happens to it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logf.Close()
		return fmt.Errorf("etcdserver: start %s: %w", m.Name, err)
	}
	done := make(chan struct{})
	go func() {
		_ = cmd.Wait()
		logf.Close()
		close(done)
	}()
	m.cmd, m.done = cmd, done
	return nil
}

// cleanEnv is the environment without ETCD_* variables, which etcd reads
// as flags.
func cleanEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "ETCD_") && !strings.HasPrefix(kv, "ETCDCTL_") {
			env = append(env, kv)
		}
	}
	return env
}

// Kill sends SIGKILL to member i and waits for it to exit.
func (c *Cluster) Kill(i int) error { return c.signal(i, syscall.SIGKILL) }

// Stop sends SIGTERM to member i (a clean shutdown) and waits for it to
// exit; after 10 s it kills it.
func (c *Cluster) Stop(i int) error { return c.signal(i, syscall.SIGTERM) }

func (c *Cluster) signal(i int, sig syscall.Signal) error {
	m := c.Members[i]
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.cmd == nil {
		return fmt.Errorf("etcdserver: %s is not running", m.Name)
	}
	_ = m.cmd.Process.Signal(sig)
	select {
	case <-m.done:
	case <-time.After(10 * time.Second):
		_ = m.cmd.Process.Kill()
		<-m.done
	}
	m.cmd, m.done = nil, nil
	return nil
}

// Running reports whether member i runs.
func (c *Cluster) Running(i int) bool {
	m := c.Members[i]
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.cmd != nil
}

// Close kills every member and removes the directory (unless Keep).
func (c *Cluster) Close() {
	for i := range c.Members {
		if c.Running(i) {
			_ = c.Kill(i)
		}
	}
	if !c.keep {
		_ = os.RemoveAll(c.dir)
	}
}

// Logs returns the tail of every member's log, for a failure message.
func (c *Cluster) Logs() string {
	var b strings.Builder
	for _, m := range c.Members {
		data, _ := os.ReadFile(m.logPath)
		if len(data) > 4000 {
			data = data[len(data)-4000:]
		}
		fmt.Fprintf(&b, "--- %s (%s)\n%s\n", m.Name, m.logPath, data)
	}
	return b.String()
}

// RunningEndpoints are the client URLs of the running members.
func (c *Cluster) RunningEndpoints() []string {
	var eps []string
	for i, m := range c.Members {
		if c.Running(i) {
			eps = append(eps, m.ClientURL)
		}
	}
	return eps
}

// gateway posts the JSON body to etcd's HTTP gateway at url+path and decodes the
// JSON reply into out.
func gateway(ctx context.Context, url, path, body string, out any) error {
	ctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+path, strings.NewReader(body))
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		data, _ := io.ReadAll(io.LimitReader(resp.Body, 1000))
		return fmt.Errorf("%s%s: %s: %s", url, path, resp.Status, data)
	}
	return json.NewDecoder(resp.Body).Decode(out)
}

// Leader returns the index of the member that is leader by the first
// running member that answers, or an error if none knows a leader.
func (c *Cluster) Leader(ctx context.Context) (int, error) {
	var last error = errors.New("no member running")
	for i, m := range c.Members {
		if !c.Running(i) {
			continue
		}
		name, err := leaderBy(ctx, m)
		if err != nil {
			last = err
			continue
		}
		for j, o := range c.Members {
			if o.Name == name {
				return j, nil
			}
		}
		last = fmt.Errorf("%s names leader %q, which is no known member", m.Name, name)
	}
	return -1, last
}

// leaderBy returns the name of the leader that member m knows. The
// gateway writes 64-bit ids as JSON strings.
func leaderBy(ctx context.Context, m *Member) (string, error) {
	var st struct {
		Leader string `json:"leader"`
	}
	if err := gateway(ctx, m.ClientURL, "/v3/maintenance/status", "{}", &st); err != nil {
		return "", err
	}
	if st.Leader == "" || st.Leader == "0" {
		return "", fmt.Errorf("%s knows no leader", m.Name)
	}
	var ml struct {
		Members []struct {
			ID   string `json:"ID"`
			Name string `json:"name"`
		} `json:"members"`
	}
	if err := gateway(ctx, m.ClientURL, "/v3/cluster/member/list", "{}", &ml); err != nil {
		return "", err
	}
	for _, pm := range ml.Members {
		if pm.ID == st.Leader {
			return pm.Name, nil
		}
	}
	return "", fmt.Errorf("%s: leader %s is not in the member list", m.Name, st.Leader)
}

// WaitReady waits until every running member answers a linearizable read
// and a leader is known, or ctx ends (default bound 60 s).
func (c *Cluster) WaitReady(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	var last error
	for {
		last = c.ready(ctx)
		if last == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("etcdserver: cluster not ready: %w\n%s", last, c.Logs())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func (c *Cluster) ready(ctx context.Context) error {
	for i, m := range c.Members {
		if !c.Running(i) {
			continue
		}
		m.mu.Lock()
		done := m.done
		m.mu.Unlock()
		select {
		case <-done:
			return fmt.Errorf("%s exited", m.Name)
		default:
		}
		// A linearizable range read: answered only with a leader.
		var r struct{}
		if err := gateway(ctx, m.ClientURL, "/v3/kv/range", `{"key":"ZXRjZHNlcnZlcg=="}`, &r); err != nil {
			return fmt.Errorf("%s: %w", m.Name, err)
		}
	}
	_, err := c.Leader(ctx)
	return err
}
