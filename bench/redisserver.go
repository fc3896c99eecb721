package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/redis/go-redis/v9"
)

// redisDurability is how a throwaway redis-server persists its writes:
// the pairing of the redis section with ashlock's release modes.
type redisDurability string

const (
	// redisAlways: appendonly yes, appendfsync always (the AOF is fsynced
	// before each write is answered), paired with DurableRelease.
	redisAlways redisDurability = "always"
	// redisEverysec: appendonly yes, appendfsync everysec (a second of
	// acknowledged writes can be lost), paired with the default
	// asynchronous release.
	redisEverysec redisDurability = "everysec"
	// redisNone: no AOF, no RDB snapshots: no durability.
	redisNone redisDurability = "none"
)

var redisDurabilities = []redisDurability{redisAlways, redisEverysec, redisNone}

// args is the command line of a redis-server for d: loopback only, the
// data directory dir, no snapshots (so that only the AOF setting decides
// what survives a crash, and no fork runs during a cell).
func (d redisDurability) args(port int, dir string) []string {
	a := []string{
		"--bind", "127.0.0.1", "--port", strconv.Itoa(port), "--dir", dir,
		"--daemonize", "no", "--protected-mode", "yes", "--save", "",
		"--logfile", filepath.Join(dir, "redis.log"),
	}
	switch d {
	case redisAlways, redisEverysec:
		a = append(a, "--appendonly", "yes", "--appendfsync", string(d))
	default:
		a = append(a, "--appendonly", "no")
	}
	return a
}

// check asks the server whether it runs as d says: the AOF on or off (and
// actually enabled, per INFO persistence), the fsync policy, no snapshots.
func (d redisDurability) check(ctx context.Context, c *redis.Client) error {
	got := map[string]string{}
	for _, k := range []string{"appendonly", "appendfsync", "save"} {
		v, err := c.ConfigGet(ctx, k).Result()
		if err != nil {
			return fmt.Errorf("CONFIG GET %s: %w", k, err)
		}
		got[k] = v[k]
	}
	info, err := c.Info(ctx, "persistence").Result()
	if err != nil {
		return fmt.Errorf("INFO persistence: %w", err)
	}
	got["aof_enabled"] = infoField(info, "aof_enabled")
	want := map[string]string{"appendonly": "no", "aof_enabled": "0", "save": ""}
	switch d {
	case redisAlways, redisEverysec:
		want["appendonly"], want["aof_enabled"], want["appendfsync"] = "yes", "1", string(d)
	}
	for k, v := range want {
		if got[k] != v {
			return fmt.Errorf("redis-server for %q runs with %s=%q, want %q", d, k, got[k], v)
		}
	}
	return nil
}

// infoField is one "name:value" line of an INFO reply.
func infoField(info, name string) string {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), name+":"); ok {
			return v
		}
	}
	return ""
}

// redisServer is one throwaway redis-server.
type redisServer struct {
	durability redisDurability
	dir        string
	addr       string
	cmd        *exec.Cmd
	done       chan error
}

// errNoRedisServer: the machine has no redis-server binary.
var errNoRedisServer = errors.New("redis-server not found on PATH or in /usr/bin (Debian: apt-get install redis-server)")

// findRedisServer is the machine's redis-server binary.
func findRedisServer() (string, error) {
	if p, err := exec.LookPath("redis-server"); err == nil {
		return p, nil
	}
	if _, err := os.Stat("/usr/bin/redis-server"); err == nil {
		return "/usr/bin/redis-server", nil
	}
	return "", errNoRedisServer
}

// startRedis starts bin with durability d in a new directory under parent,
// on a free loopback port, and waits until it answers and runs with d.
func startRedis(ctx context.Context, bin, parent string, d redisDurability) (*redisServer, error) {
	var last error
	for range 3 { // the free port can be taken between our probe and the server's bind
		s, err := tryStartRedis(ctx, bin, parent, d)
		if err == nil {
			return s, nil
		}
		last = err
	}
	return nil, last
}

func tryStartRedis(ctx context.Context, bin, parent string, d redisDurability) (*redisServer, error) {
	dir, err := os.MkdirTemp(parent, "redis-"+string(d)+"-")
	if err != nil {
		return nil, err
	}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	s := &redisServer{durability: d, dir: dir, addr: net.JoinHostPort("127.0.0.1", strconv.Itoa(port)), done: make(chan error, 1)}
	s.cmd = exec.Command(bin, d.args(port, dir)...)
	s.cmd.Dir = dir
	s.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := s.cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s: %w", bin, err)
	}
	go func() { s.done <- s.cmd.Wait() }()
	c := redis.NewClient(&redis.Options{Addr: s.addr, MaxRetries: -1})
	defer c.Close()
	deadline := time.Now().Add(10 * time.Second)
	for {
		select {
		case err := <-s.done:
			s.done <- err
			return nil, fmt.Errorf("redis-server (%s) exited: %v; log: %s", d, err, tail(filepath.Join(dir, "redis.log")))
		default:
		}
		if err := c.Ping(ctx).Err(); err == nil {
			break
		} else if time.Now().After(deadline) || ctx.Err() != nil {
			s.stop()
			return nil, fmt.Errorf("redis-server (%s) on %s does not answer: %v", d, s.addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := d.check(ctx, c); err != nil {
		s.stop()
		return nil, err
	}
	return s, nil
}

// stop ends the server (SIGTERM, then SIGKILL after 5 s) and removes its
// directory.
func (s *redisServer) stop() {
	_ = s.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-s.done:
	case <-time.After(5 * time.Second):
		_ = s.cmd.Process.Kill()
		<-s.done
	}
	_ = os.RemoveAll(s.dir)
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// tail is the end of a log file, for an error message.
func tail(path string) string {
	b, err := os.ReadFile(path)
	if err != nil {
		return err.Error()
	}
	if len(b) > 600 {
		b = b[len(b)-600:]
	}
	return strings.TrimSpace(string(b))
}
