// Command bench measures ashlock against the raw statements of its design
// (the limit), against other lock libraries and against the machine: run
// `go run .` in this directory (see README.md).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"
)

type config struct {
	quick       bool
	flags       []string // as given, for the report (see main)
	databaseURL string
	etcd        string
	etcdMembers int
	out         string
	rounds      int
	dur         time.Duration
	conc        []int
	keys        int
	only        map[string]bool
}

func (c *config) want(section string) bool { return len(c.only) == 0 || c.only[section] }

var sections = []string{"pg", "hotkey", "handoff", "takeover", "async", "renewal", "groupcommit", "multikey", "sqlite", "memory", "etcd", "mariadb", "redis"}

func main() {
	var cfg config
	var conc, only, render string
	flag.BoolVar(&cfg.quick, "quick", false, "a short run (under 2 minutes): 1 round, shorter cells, fewer samples")
	flag.StringVar(&cfg.databaseURL, "database-url", "", "PostgreSQL to use (postgres://...); default: start a throwaway server from the local PostgreSQL binaries")
	flag.StringVar(&cfg.etcd, "etcd-endpoints", "", "etcd to use (comma-separated client URLs); default: start a throwaway one-member server from the local etcd binary")
	flag.IntVar(&cfg.etcdMembers, "etcd-members", 1, "members of the throwaway etcd cluster: 1 or 3")
	flag.StringVar(&cfg.out, "out", "results", "directory for latest.md, latest.json and the chart")
	flag.IntVar(&cfg.rounds, "rounds", 0, "interleaved rounds per cell (default 5, -quick 1)")
	flag.DurationVar(&cfg.dur, "duration", 0, "duration of one PostgreSQL throughput cell (default 1.2s, -quick 700ms; other sections scale from it)")
	flag.StringVar(&conc, "goroutines", "1,4,16,64", "PostgreSQL concurrencies")
	flag.IntVar(&cfg.keys, "keys", 10000, "random keys are drawn from this many")
	flag.StringVar(&only, "only", "", "comma-separated sections to run (default all): "+strings.Join(sections, ","))
	flag.StringVar(&render, "render", "", "measure nothing: rewrite latest.md and the chart in -out from this latest.json")
	flag.Parse()
	cfg.flags = runFlags(flag.CommandLine)
	if render != "" {
		r, err := readReport(render)
		if err == nil {
			err = r.write(cfg.out, false)
		}
		if err != nil {
			fatalf("%v", err)
		}
		return
	}
	if cfg.rounds == 0 {
		cfg.rounds = 5
		if cfg.quick {
			cfg.rounds = 1
		}
	}
	if cfg.dur == 0 {
		cfg.dur = 1200 * time.Millisecond
		if cfg.quick {
			cfg.dur = 700 * time.Millisecond
		}
	}
	for _, s := range strings.Split(conc, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 {
			fatalf("bad -goroutines %q", conc)
		}
		cfg.conc = append(cfg.conc, n)
	}
	if only != "" {
		cfg.only = map[string]bool{}
		for _, s := range strings.Split(only, ",") {
			if !slices.Contains(sections, s) {
				fatalf("unknown section %q (want %s)", s, strings.Join(sections, ","))
			}
			cfg.only[s] = true
		}
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, &cfg); err != nil {
		fatalf("%v", err)
	}
}

// runFlags are the flags set on fs that make a run other than the
// default, as the report's first line shows them: never a URL's value (it
// may hold a password), nor -out and -render, which change no figure.
func runFlags(fs *flag.FlagSet) []string {
	var out []string
	fs.Visit(func(f *flag.Flag) {
		switch f.Name {
		case "out", "render":
		case "database-url", "etcd-endpoints":
			out = append(out, "-"+f.Name+"=…")
		case "quick":
			out = append(out, "-quick="+f.Value.String())
		default:
			out = append(out, "-"+f.Name+"="+f.Value.String())
		}
	})
	return out
}

func fatalf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "bench: "+format+"\n", args...)
	os.Exit(1)
}

var startTime = time.Now()

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, "[%6.1fs] %s\n", time.Since(startTime).Seconds(), fmt.Sprintf(format, args...))
}

func run(ctx context.Context, cfg *config) (err error) {
	rep := &Report{Started: startTime.UTC(), Quick: cfg.quick, Flags: cfg.flags, Rounds: cfg.rounds, CellSeconds: cfg.dur.Seconds(), Keys: cfg.keys}
	// The redis section needs the machine's redis-server; without one it is
	// skipped, and the report says so.
	redisBin := ""
	if cfg.want("redis") {
		if redisBin, err = findRedisServer(); err != nil {
			logf("skipping the redis section: %v", err)
			rep.Redis = &RedisResult{Skipped: err.Error()}
		}
	}
	needPG := redisBin != ""
	for _, s := range []string{"pg", "hotkey", "handoff", "takeover", "async", "renewal", "groupcommit", "multikey"} {
		needPG = needPG || cfg.want(s)
	}
	tmp, err := os.MkdirTemp("", "ashlock-bench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tmp)

	var pe *pgEnv
	if needPG {
		url := cfg.databaseURL
		if url == "" {
			srv, err := startPG(logf)
			if err != nil {
				return err
			}
			defer stopPG(srv)
			url = srv.URL
			rep.Env.PGDataDir = srv.DataDir
		}
		pe, err = setupPG(ctx, url, slices.Max(cfg.conc), cfg.keys)
		if err != nil {
			return fmt.Errorf("set up PostgreSQL: %w", err)
		}
		defer pe.close(context.Background(), cfg.databaseURL != "")
	}
	rep.Env = describeEnv(ctx, pe, tmp, rep.Env.PGDataDir)
	logf("machine: %s", rep.Env.summary())

	if cfg.want("pg") {
		m := pe.throughput(cfg)
		if err := m.run(ctx, logf); err != nil {
			return err
		}
		rep.addMatrix(m, pgRatios)
	}
	if cfg.want("hotkey") {
		m, err := pe.hotKey(ctx, cfg)
		if err != nil {
			return fmt.Errorf("hot key: %w", err)
		}
		if err := m.run(ctx, logf); err != nil {
			return err
		}
		rep.addMatrix(m, hotkeyRatios)
	}
	var pglockHandoff func() (Latency, error)
	if cfg.want("handoff") {
		pglockHandoff = pe.startPglockHandoff(ctx, cfg)
		if rep.Handoff, err = pe.handoff(ctx, cfg); err != nil {
			return fmt.Errorf("handoff: %w", err)
		}
	}
	if cfg.want("takeover") {
		if rep.Takeover, err = takeover(ctx, cfg, pe, tmp); err != nil {
			return fmt.Errorf("takeover: %w", err)
		}
	}
	if pglockHandoff != nil {
		l, err := pglockHandoff()
		if err != nil {
			return fmt.Errorf("pglock handoff: %w", err)
		}
		rep.Handoff = append(rep.Handoff, l)
	}
	if cfg.want("async") {
		if rep.Async, err = pe.asyncRelease(ctx, cfg); err != nil {
			return fmt.Errorf("async release: %w", err)
		}
	}
	if cfg.want("renewal") {
		if rep.Renewal, err = pe.renewal(ctx, cfg); err != nil {
			return fmt.Errorf("renewal: %w", err)
		}
		if rep.BatchRenew, err = pe.batchRenew(ctx, cfg); err != nil {
			return fmt.Errorf("batch renewal: %w", err)
		}
	}
	if cfg.want("groupcommit") {
		m, stop, err := pe.groupCommit(ctx, cfg)
		if err != nil {
			return fmt.Errorf("groupcommit: %w", err)
		}
		err = m.run(ctx, logf)
		stop()
		if err != nil {
			return err
		}
		rep.addMatrix(m, groupCommitRatios)
	}
	if cfg.want("multikey") {
		m := pe.multiKey(cfg)
		if err := m.run(ctx, logf); err != nil {
			return err
		}
		rep.addMatrix(m, multiKeyRatios)
		sm, stop, err := multiKeySQLite(ctx, cfg, tmp)
		if err != nil {
			return fmt.Errorf("multikey: %w", err)
		}
		err = sm.run(ctx, logf)
		stop()
		if err != nil {
			return err
		}
		rep.addMatrix(sm, multiKeyRatios)
	}
	if cfg.want("sqlite") {
		m, stats, err := sqliteMatrix(ctx, cfg, tmp)
		if err != nil {
			return fmt.Errorf("sqlite: %w", err)
		}
		if err := m.run(ctx, logf); err != nil {
			return err
		}
		rep.SQLiteBusyRetries = stats()
		rep.addMatrix(m, sqliteRatios)
	}
	if cfg.want("memory") {
		m := memoryMatrix(cfg)
		if err := m.run(ctx, logf); err != nil {
			return err
		}
		rep.addMatrix(m, memoryRatios)
	}
	if cfg.want("etcd") {
		e, err := startEtcd(ctx, cfg.etcd, cfg.etcdMembers)
		if err != nil {
			return err
		}
		defer e.close()
		m, err := e.matrix(cfg)
		if err != nil {
			return fmt.Errorf("etcd: %w", err)
		}
		if err := m.run(ctx, logf); err != nil {
			return err
		}
		rep.addMatrix(m, etcdRatios)
		rep.Etcd = &EtcdResult{Version: e.version, Members: e.members, External: e.cluster == nil}
		if rep.Etcd.Handoff, err = e.handoff(ctx, cfg); err != nil {
			return fmt.Errorf("etcd handoff: %w", err)
		}
	}
	if cfg.want("mariadb") {
		e, err := startMariaDB(ctx)
		if err != nil {
			return err
		}
		defer e.close()
		m, err := e.matrix(ctx, cfg)
		if err != nil {
			return fmt.Errorf("mariadb: %w", err)
		}
		if err := m.run(ctx, logf); err != nil {
			return err
		}
		rep.addMatrix(m, mariadbRatios)
		rep.MariaDBVersion = e.version
	}
	if redisBin != "" {
		if rep.Redis, err = redisSection(ctx, cfg, pe, redisBin, tmp, rep); err != nil {
			return fmt.Errorf("redis: %w", err)
		}
	}
	rep.Seconds = time.Since(startTime).Seconds()
	if err := rep.write(cfg.out, true); err != nil {
		return err
	}
	logf("done in %s; wrote %s/latest.md, latest.json, %s", time.Since(startTime).Round(time.Second), cfg.out, chartFile)
	return nil
}

// write puts the report (and, with withJSON, its JSON) and the chart in dir.
func (r *Report) write(dir string, withJSON bool) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	md := r.markdown()
	fmt.Print(md)
	if err := os.WriteFile(filepath.Join(dir, "latest.md"), []byte(md), 0o644); err != nil {
		return err
	}
	if withJSON {
		if err := r.writeJSON(filepath.Join(dir, "latest.json")); err != nil {
			return err
		}
	}
	if err := r.chart(filepath.Join(dir, chartFile)); err != nil {
		return fmt.Errorf("chart: %w", err)
	}
	return nil
}

// warmup is how long each contender runs, unmeasured, before a matrix.
func (c *config) warmup() time.Duration {
	if c.quick {
		return 200 * time.Millisecond
	}
	return 400 * time.Millisecond
}
