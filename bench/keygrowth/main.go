// Command keygrowth measures what a lock table costs when every key is
// locked once and never again (per-entity keys: order:81723, customer:42):
// rows, table and index bytes, List time and acquire latency after N
// distinct keys, next to a table that only ever held a few. Run it from the
// bench module: `go run ./keygrowth` (docs/key-reaping.md has the figures).
//
// The rows are bulk-loaded with SQL that writes what one acquire and one
// release of each key would leave (token 1, released, the releaser as
// owner, the grant's deadline), and a few of them are then acquired for real
// to show the backend takes them as its own (token 2).
package main

import (
	"context"
	"database/sql"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/ashlock/ashlock/dialect/postgres"
	"github.com/ashlock/ashlock/dialect/sqlite"
	"github.com/ashlock/ashlock/internal/testkit/pgserver"
	"github.com/ashlock/ashlock/sqllock"
)

type figures struct {
	label                  string
	sizeOnly               bool
	compacted              bool // reaped is the rows Compact moved, reapTime its time
	reaped                 int
	reapTime               time.Duration
	walBytes               int64
	rows                   int64
	tableBytes, indexBytes int64
	listAll, listPrefix    time.Duration
	fresh, existing        time.Duration // median acquire latencies
}

func main() {
	big := flag.Int("keys", 1_000_000, "distinct keys, each locked once")
	small := flag.Int("small", 1000, "keys of the small table compared with")
	samples := flag.Int("samples", 400, "acquires timed per kind")
	only := flag.String("only", "sqlite,postgres", "backends to measure")
	roll := flag.Bool("rolling", false, "instead: lock -keys keys once each, -live held at a time, reaping from the start (PostgreSQL)")
	live := flag.Int("live", 10_000, "with -rolling: the keys held at any time")
	batch := flag.Int("batch", 10_000, "with -rolling: keys acquired, released and reaped per round")
	flag.Parse()
	ctx := context.Background()
	if *roll {
		srv, err := pgserver.Start(pgserver.Options{Durable: true})
		check(err)
		defer func() { _ = srv.Stop(pgserver.StopFast); _ = os.RemoveAll(srv.DataDir) }()
		r := rolling{n: *big, live: *live, batch: *batch}
		f, err := r.measurePG(ctx, srv.URL)
		check(err)
		r.report("postgres", f)
		return
	}
	tmp, err := os.MkdirTemp("", "keygrowth")
	check(err)
	defer os.RemoveAll(tmp)
	if strings.Contains(*only, "sqlite") {
		for _, n := range []int{*small, *big} {
			fs, err := measureSQLite(ctx, filepath.Join(tmp, fmt.Sprintf("s%d.db", n)), n, *samples)
			check(err)
			for _, f := range fs {
				report("sqlite", n, f)
			}
		}
	}
	if strings.Contains(*only, "postgres") {
		srv, err := pgserver.Start(pgserver.Options{Durable: true})
		check(err)
		defer func() { _ = srv.Stop(pgserver.StopFast); _ = os.RemoveAll(srv.DataDir) }()
		for _, n := range []int{*small, *big} {
			fs, err := measurePG(ctx, srv.URL, n, *samples)
			check(err)
			for _, f := range fs {
				report("postgres", n, f)
			}
		}
	}
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "keygrowth:", err)
		os.Exit(1)
	}
}

func report(backend string, n int, f figures) {
	if f.sizeOnly {
		fmt.Printf("%-8s keys=%-8d %s: rows=%d table=%.2f MiB index=%.2f MiB\n", backend, n, f.label, f.rows,
			float64(f.tableBytes)/(1<<20), float64(f.indexBytes)/(1<<20))
		return
	}
	if f.compacted {
		fmt.Printf("%-8s keys=%-8d %s: moved %d rows in %v (%.1f MiB WAL)\n", backend, n, f.label, f.reaped,
			f.reapTime.Round(time.Millisecond), float64(f.walBytes)/(1<<20))
	} else if f.label != "" {
		fmt.Printf("%-8s keys=%-8d %s: reaped %d in %v (%d statements, %.1f MiB WAL)\n", backend, n, f.label, f.reaped,
			f.reapTime.Round(time.Millisecond), (f.reaped+sqllock.DefaultReapLimit)/sqllock.DefaultReapLimit, float64(f.walBytes)/(1<<20))
	}
	fmt.Printf("%-8s keys=%-8d rows=%-8d table=%7.2f MiB index=%7.2f MiB list(all)=%-9v list(prefix, 10 rows)=%-9v acquire fresh p50=%-8v existing p50=%v\n",
		backend, n, f.rows, float64(f.tableBytes)/(1<<20), float64(f.indexBytes)/(1<<20),
		f.listAll.Round(time.Millisecond), f.listPrefix.Round(time.Microsecond),
		f.fresh.Round(time.Microsecond), f.existing.Round(time.Microsecond))
}

func key(i int) string { return fmt.Sprintf("order:%08d", i) }

// timings runs the checks that every backend shares: real acquires of a few
// loaded keys (each must get token 2), List, and acquire latency of fresh
// keys and of one existing key.
func timings(ctx context.Context, b sqllock.Backend, n, samples int, f *figures, loaded bool) error {
	for _, i := range []int{0, n / 2, n - 1} {
		if !loaded {
			break
		}
		l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key(i), TTL: time.Minute, Owner: "verify"})
		if err != nil {
			return fmt.Errorf("acquire loaded key %s: %w", key(i), err)
		}
		if l.Token != 2 {
			return fmt.Errorf("loaded key %s: token %d, want 2 (the load is not what an acquire writes)", key(i), l.Token)
		}
		if err := b.Release(ctx, l); err != nil {
			return err
		}
	}
	begin := time.Now()
	all, err := b.List(ctx, "")
	if err != nil {
		return err
	}
	f.listAll = time.Since(begin)
	if len(all) != n {
		return fmt.Errorf("list: %d keys, want %d", len(all), n)
	}
	begin = time.Now()
	if _, err := b.List(ctx, key(n / 2)[:len(key(0))-1]); err != nil {
		return err
	}
	f.listPrefix = time.Since(begin)
	var fresh, existing []time.Duration
	for i := range samples {
		// Before the reap: fresh keys "fresh:i", existing ones the loaded
		// keys; after it, fresh keys "new:i", existing ones "fresh:i"
		// (which the reap kept: they ended within the hour).
		freshKey, existingKey := fmt.Sprintf("fresh:%d", i), key((i*7919)%max(n, 1))
		if !loaded {
			freshKey, existingKey = fmt.Sprintf("new:%d", i), fmt.Sprintf("fresh:%d", i)
		}
		req := sqllock.AcquireRequest{Key: freshKey, TTL: time.Minute, Owner: fmt.Sprintf("f%d", i)}
		begin := time.Now()
		l, err := b.TryAcquire(ctx, req)
		fresh = append(fresh, time.Since(begin))
		if err != nil {
			return err
		}
		if err := b.Release(ctx, l); err != nil {
			return err
		}
		req = sqllock.AcquireRequest{Key: existingKey, TTL: time.Minute, Owner: fmt.Sprintf("e%d", i)}
		begin = time.Now()
		l, err = b.TryAcquire(ctx, req)
		existing = append(existing, time.Since(begin))
		if err != nil {
			return err
		}
		if err := b.Release(ctx, l); err != nil {
			return err
		}
	}
	f.fresh, f.existing = median(fresh), median(existing)
	return nil
}

func median(d []time.Duration) time.Duration {
	slices.Sort(d)
	return d[len(d)/2]
}

func measureSQLite(ctx context.Context, path string, n, samples int) ([]figures, error) {
	b, err := sqlite.Open(path, sqlite.Options{})
	if err != nil {
		return nil, err
	}
	defer b.Close()
	dsn, err := sqlite.DSN(path, sqlite.Options{})
	if err != nil {
		return nil, err
	}
	db, err := sql.Open("sqlite", dsn)
	if err != nil {
		return nil, err
	}
	defer db.Close()
	db.SetMaxOpenConns(1)
	// What an acquire (token 1, a 1-minute lease a day ago) and the
	// holder's release (held 0, owner the releaser) leave, in one
	// transaction.
	_, err = db.ExecContext(ctx, `WITH RECURSIVE i(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM i WHERE n + 1 < ?1)
		INSERT INTO sqllock_locks (key, token, held, deadline, owner, value, hold_until)
		SELECT printf('order:%08d', n), 1, 0, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) - 86400000, 'app/' || n, NULL, NULL FROM i`, n)
	if err != nil {
		return nil, fmt.Errorf("load: %w", err)
	}
	sizes := func(f *figures) error {
		if err := db.QueryRowContext(ctx, `SELECT count(*) FROM sqllock_locks`).Scan(&f.rows); err != nil {
			return err
		}
		// The table and its primary-key index (sqlite_autoindex_*).
		return db.QueryRowContext(ctx, `SELECT coalesce(sum(CASE WHEN name = 'sqllock_locks' THEN pgsize END), 0),
			coalesce(sum(CASE WHEN name LIKE 'sqlite_autoindex_sqllock_locks%' THEN pgsize END), 0) FROM dbstat`).Scan(&f.tableBytes, &f.indexBytes)
	}
	var before figures
	if err := sizes(&before); err != nil {
		return nil, err
	}
	if err := timings(ctx, b, n, samples, &before, true); err != nil {
		return nil, err
	}
	after := figures{label: "after sqllock.Reap(1h)"}
	begin := time.Now()
	if after.reaped, err = sqllock.Reap(ctx, b, time.Hour); err != nil {
		return nil, err
	}
	after.reapTime = time.Since(begin)
	if err := sizes(&after); err != nil {
		return nil, err
	}
	if err := timings(ctx, b, int(after.rows), samples, &after, false); err != nil {
		return nil, err
	}
	vac := figures{label: "after VACUUM (file pages back to the OS)", sizeOnly: true}
	if _, err := db.ExecContext(ctx, `VACUUM`); err != nil {
		return nil, err
	}
	if err := sizes(&vac); err != nil {
		return nil, err
	}
	return []figures{before, after, vac}, nil
}

func measurePG(ctx context.Context, serverURL string, n, samples int) ([]figures, error) {
	pool, err := pgDB(ctx, serverURL, fmt.Sprintf("growth_%d", n))
	if err != nil {
		return nil, err
	}
	defer pool.Close()
	_, err = pool.Exec(ctx, `INSERT INTO sqllock_locks (key, token, held, deadline, owner)
		SELECT format('order:%s', lpad(i::text, 8, '0')), 1, false, clock_timestamp() - interval '1 day', 'app/' || i
		FROM generate_series(0, $1::int - 1) AS i`, n)
	if err != nil {
		return nil, fmt.Errorf("load: %w", err)
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE sqllock_locks`); err != nil {
		return nil, err
	}
	b, err := postgres.New(pool, postgres.Options{})
	if err != nil {
		return nil, err
	}
	defer b.Close()
	sizes := func(f *figures) (err error) {
		f.rows, f.tableBytes, f.indexBytes, err = pgSizes(ctx, pool)
		return err
	}
	var before figures
	if err := sizes(&before); err != nil {
		return nil, err
	}
	if err := timings(ctx, b, n, samples, &before, true); err != nil {
		return nil, err
	}
	after := figures{label: "after sqllock.Reap(1h), then VACUUM (as autovacuum would)"}
	var lsn0, lsn1 string
	if err := pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&lsn0); err != nil {
		return nil, err
	}
	begin := time.Now()
	if after.reaped, err = sqllock.Reap(ctx, b, time.Hour); err != nil {
		return nil, err
	}
	after.reapTime = time.Since(begin)
	if err := pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&lsn1); err != nil {
		return nil, err
	}
	if err := pool.QueryRow(ctx, `SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::bigint`, lsn1, lsn0).Scan(&after.walBytes); err != nil {
		return nil, err
	}
	if _, err := pool.Exec(ctx, `VACUUM ANALYZE sqllock_locks`); err != nil {
		return nil, err
	}
	if err := sizes(&after); err != nil {
		return nil, err
	}
	if err := timings(ctx, b, int(after.rows), samples, &after, false); err != nil {
		return nil, err
	}
	compacted := figures{label: "after Backend.Compact (moves the live rows, VACUUM, REINDEX CONCURRENTLY; no ACCESS EXCLUSIVE wait)", compacted: true}
	if err := pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&lsn0); err != nil {
		return nil, err
	}
	begin = time.Now()
	cs, err := b.Compact(ctx)
	if err != nil {
		return nil, err
	}
	compacted.reapTime = time.Since(begin)
	compacted.reaped = int(cs.Moved)
	if err := pool.QueryRow(ctx, `SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::bigint`, lsn0).Scan(&compacted.walBytes); err != nil {
		return nil, err
	}
	if err := sizes(&compacted); err != nil {
		return nil, err
	}
	if err := timings(ctx, b, int(compacted.rows), samples, &compacted, false); err != nil {
		return nil, err
	}
	full := figures{label: "after VACUUM FULL (rewrites the table; ACCESS EXCLUSIVE while it runs)", sizeOnly: true}
	if _, err := pool.Exec(ctx, `VACUUM FULL sqllock_locks`); err != nil {
		return nil, err
	}
	if err := sizes(&full); err != nil {
		return nil, err
	}
	return []figures{before, after, compacted, full}, nil
}
