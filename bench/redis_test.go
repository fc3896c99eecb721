package main

import (
	"errors"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/bsm/redislock"
	"github.com/go-redsync/redsync/v4"
	"github.com/go-redsync/redsync/v4/redis/goredis/v9"

	"github.com/ashlock/ashlock/internal/lockbench"
)

func TestRedisArgsPairDurability(t *testing.T) {
	for _, c := range []struct {
		d    redisDurability
		want []string
	}{
		{redisAlways, []string{"--appendonly yes", "--appendfsync always"}},
		{redisEverysec, []string{"--appendonly yes", "--appendfsync everysec"}},
		{redisNone, []string{"--appendonly no"}},
	} {
		line := strings.Join(c.d.args(6379, "/d"), " ")
		for _, w := range append(c.want, `--save `, "--bind 127.0.0.1") {
			if !strings.Contains(line, w) {
				t.Errorf("%s: %q lacks %q", c.d, line, w)
			}
		}
		if c.d == redisNone && strings.Contains(line, "appendfsync") {
			t.Errorf("%s: %q sets an fsync policy", c.d, line)
		}
	}
}

// redisBin skips the test when the machine has no redis-server: the
// bench's unit tests must pass without one, unless SQLLOCK_REQUIRE_REDIS=1
// (CI sets it) makes a missing server a failure.
func redisBin(t *testing.T) string {
	t.Helper()
	bin, err := findRedisServer()
	if err != nil {
		if os.Getenv("SQLLOCK_REQUIRE_REDIS") == "1" {
			t.Fatalf("no Redis here, and SQLLOCK_REQUIRE_REDIS=1: %v", err)
		}
		t.Skipf("no Redis here: %v", err)
	}
	return bin
}

func testRedisEnv(t *testing.T, keys []string) *redisEnv {
	t.Helper()
	bin := redisBin(t)
	e, err := startRedisEnv(t.Context(), bin, t.TempDir(), 4, keys, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(e.close)
	return e
}

// Each server runs with the durability it is labelled with, and check
// refuses a server that runs otherwise (everysec checked as always differs
// only in appendfsync).
func TestRedisServersRunAsLabelled(t *testing.T) {
	e := testRedisEnv(t, []string{"k"})
	ctx := t.Context()
	for _, d := range redisDurabilities {
		if err := d.check(ctx, e.clients[d]); err != nil {
			t.Errorf("%s: %v", d, err)
		}
	}
	if err := redisAlways.check(ctx, e.clients[redisEverysec]); err == nil || !strings.Contains(err.Error(), "appendfsync") {
		t.Errorf("everysec server checked as always: %v, want an appendfsync mismatch", err)
	}
	if err := redisEverysec.check(ctx, e.clients[redisNone]); err == nil {
		t.Errorf("persistence-off server checked as everysec: nil error")
	}
	if e.version == "" {
		t.Errorf("no redis_version")
	}
}

// A pair of either library holds a free key and leaves nothing behind; a
// hot-key attempt on a held key is refused, not an error and not a grant;
// the hook counts the round trips.
func TestRedisContenders(t *testing.T) {
	e := testRedisEnv(t, []string{"k1", "k2"})
	ctx := t.Context()
	for _, d := range redisDurabilities {
		for _, c := range []contender{e.redislockPair("redislock", d), e.redsyncPair("redsync", d)} {
			f := c.newWorker(0, rand.New(rand.NewPCG(1, 2)))
			before := e.sent.n.Load()
			held, err := f(ctx)
			if !held || err != nil {
				t.Errorf("%s on %s: held %v, err %v", c.name, d, held, err)
			}
			if n := e.sent.n.Load() - before; n < 2 {
				t.Errorf("%s on %s: %d round trips counted for a pair", c.name, d, n)
			}
			if keys, err := e.clients[d].Keys(ctx, "*").Result(); err != nil || len(keys) != 0 {
				t.Errorf("%s on %s: keys left after the pair: %v %v", c.name, d, keys, err)
			}
		}
	}
	c := e.clients[redisAlways]
	if _, err := redislock.New(c).Obtain(ctx, "rl:held", time.Minute, nil); err != nil {
		t.Fatal(err)
	}
	rs := redsync.New(goredis.NewPool(c))
	if err := rs.NewMutex("rs:held", redsync.WithExpiry(time.Minute)).TryLockContext(ctx); err != nil {
		t.Fatal(err)
	}
	_, err := redislock.New(c).Obtain(ctx, "rl:held", time.Minute, nil)
	if held, err := hotResult(errors.Is(err, redislock.ErrNotObtained), err); held || err != nil {
		t.Errorf("redislock on a held key: held %v, err %v", held, err)
	}
	err = rs.NewMutex("rs:held", redsync.WithExpiry(time.Minute)).TryLockContext(ctx)
	if held, err := hotResult(isRedsyncTaken(err), err); held || err != nil {
		t.Errorf("redsync on a held key: held %v, err %v", held, err)
	}
	if held, err := hotResult(false, nil); !held || !errors.Is(err, lockbench.ErrStole) {
		t.Errorf("a granted hot-key attempt: held %v, err %v, want lockbench.ErrStole", held, err)
	}
}

// The section is listed among those -only accepts.
func TestRedisSectionListed(t *testing.T) {
	if !slices.Contains(sections, "redis") {
		t.Errorf("sections %v lack redis", sections)
	}
}
