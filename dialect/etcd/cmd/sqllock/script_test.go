package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rogpeppe/go-internal/testscript"

	"github.com/ashlock/ashlock/dialect/etcd/internal/etcdtest"
	"github.com/ashlock/ashlock/internal/cli"
	"github.com/ashlock/ashlock/internal/cli/clitest"
	"github.com/ashlock/ashlock/internal/testkit/leakcheck"
)

// TestMain builds nothing: testscript re-executes this test binary as the
// "sqllock" command (main itself), and as run's supervisor, which run
// starts as its own executable. After the tests it stops the shared etcd
// and checks for leaked goroutines.
func TestMain(m *testing.M) {
	if os.Getenv(cli.EnvSupervisor) != "" {
		main() // RunWith is the supervisor then; it exits
	}
	testscript.Main(leakCheckedMain{m}, map[string]func(){
		"sqllock": main,
		"exitto":  clitest.ExittoMain,
	})
}

type leakCheckedMain struct{ m *testing.M }

func (l leakCheckedMain) Run() int { return leakcheck.Check(etcdtest.Main(l.m)) }

// sharedScripts are the scripts of cmd/sqllock that TestScriptEtcd runs
// on etcd as well: those whose outcome depends on the backend. Left out:
// those that skip on every database but SQLite (the processes, exit
// statuses and terminals are the same on every backend), those about SQL
// tables (bench's missing table, messages, migrate), prune (etcd's first
// reap only starts its clock: etcd.txtar tests etcd's prune), and run_ttl,
// which holds run through a hook of the root module's test binary.
var sharedScripts = []string{
	"run_basic",
	"run_contention",
	"run_lease_lost",
	"list_release",
	"elect",
	"run_permits",
	"run_shared",
	"run_lease_lost_status",
	"run_max_hold",
	"run_signals",
	"run_log",
	"list_watch",
	"wait_progress",
}

// TestScriptEtcd runs etcd's own scripts (testdata/script) and
// sharedScripts against the shared etcd, each under a key prefix of its
// own (deleted when it passes). Without an etcd they skip, or fail when
// SQLLOCK_REQUIRE_ETCD=1.
func TestScriptEtcd(t *testing.T) {
	p := clitest.Params("", "etcd", func(e *testscript.Env) error {
		tb := e.T().(testing.TB)
		c := etcdtest.Client(tb)
		prefix := etcdtest.Prefix(tb, c)
		var hosts []string
		for _, ep := range etcdtest.Endpoints(tb) {
			hosts = append(hosts, ep[strings.Index(ep, "://")+3:])
		}
		e.Setenv(cli.EnvDatabaseURL, "etcd://"+strings.Join(hosts, ",")+"/"+prefix)
		e.Setenv("ETCD_HOSTS", strings.Join(hosts, ","))
		e.Setenv("ETCD_PREFIX", prefix)
		return nil
	}, nil)
	own, err := filepath.Glob("testdata/script/*.txtar")
	if err != nil || len(own) == 0 {
		t.Fatalf("no scripts of its own: %v", err)
	}
	p.Files = own
	for _, name := range sharedScripts {
		p.Files = append(p.Files, filepath.Join("..", "..", "..", "..", "cmd", "sqllock", "testdata", "script", name+".txtar"))
	}
	testscript.Run(t, p)
}
