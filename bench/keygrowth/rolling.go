package main

import (
	"context"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/ashlock/ashlock/dialect/postgres"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// rolling is a service that locks n distinct keys once each, with live
// of them held at any time, and reaps from the start: in rounds of batch
// keys, the next batch is acquired (held), the oldest batch held is
// released, sqllock.Reap deletes what ended more than the retention ago,
// and VACUUM runs as autovacuum would. The released rows' leases end
// past the retention at once (a retention of an hour, leases that ended
// two hours ago), so the rows kept are the live ones: what the table
// should shrink to, next to a table that only ever held them.
type rolling struct {
	n, live, batch int
}

// rollFigures are a rolling run's sizes: at the end, at the largest
// seen, and of a table that only ever held the live keys.
type rollFigures struct {
	rows, tableBytes, indexBytes int64
	peakTable, peakIndex         int64
	refTable, refIndex           int64
	reaped                       int
	reapTime, took               time.Duration
	walBytes                     int64
}

func (r rolling) report(backend string, f rollFigures) {
	total := float64(f.tableBytes + f.indexBytes)
	ref := float64(f.refTable + f.refIndex)
	fmt.Printf("%-8s rolling keys=%d live=%d batch=%d: rows=%d table=%.2f MiB index=%.2f MiB (largest %.2f + %.2f MiB); "+
		"a table that only held the live keys: %.2f + %.2f MiB; ratio %.2f; reaped %d in %v (%.1f MiB WAL in all), %v in all\n",
		backend, r.n, r.live, r.batch, f.rows, float64(f.tableBytes)/(1<<20), float64(f.indexBytes)/(1<<20),
		float64(f.peakTable)/(1<<20), float64(f.peakIndex)/(1<<20),
		float64(f.refTable)/(1<<20), float64(f.refIndex)/(1<<20), total/ref,
		f.reaped, f.reapTime.Round(time.Millisecond), float64(f.walBytes)/(1<<20), f.took.Round(time.Second))
}

// pgDB creates database name on the server and returns a pool on it with
// the lock table migrated.
func pgDB(ctx context.Context, serverURL, name string) (*pgxpool.Pool, error) {
	admin, err := pgx.Connect(ctx, serverURL)
	if err != nil {
		return nil, err
	}
	defer admin.Close(ctx)
	if _, err := admin.Exec(ctx, `CREATE DATABASE `+name); err != nil {
		return nil, err
	}
	cfg, err := pgxpool.ParseConfig(serverURL)
	if err != nil {
		return nil, err
	}
	cfg.ConnConfig.Database = name
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, err
	}
	sdb := stdlib.OpenDBFromPool(pool)
	defer sdb.Close()
	if err := migrations.Up(ctx, migrations.Postgres, sdb, migrations.Options{}); err != nil {
		pool.Close()
		return nil, err
	}
	return pool, nil
}

// acquireSQL writes what TryAcquire of fresh keys lo..hi-1 writes: a first
// row each, held for an hour, at the floor's next token.
const acquireSQL = `INSERT INTO sqllock_locks (key, token, held, deadline, owner)
	SELECT format('order:%s', lpad(i::text, 8, '0')), (SELECT last_value FROM sqllock_locks_floor) + 1, true,
	       statement_timestamp() + interval '1 hour', 'app/' || i
	FROM generate_series($1::int, $2::int - 1) AS i`

// releaseSQL writes what the holder's Release of keys lo..hi-1 writes, and
// dates their leases' end two hours back (past the hour of retention).
const releaseSQL = `UPDATE sqllock_locks SET held = false, deadline = statement_timestamp() - interval '2 hours'
	WHERE key >= format('order:%s', lpad($1::int::text, 8, '0')) AND key < format('order:%s', lpad($2::int::text, 8, '0'))`

func pgSizes(ctx context.Context, pool *pgxpool.Pool) (rows, table, index int64, err error) {
	err = pool.QueryRow(ctx, `SELECT count(*), pg_table_size('sqllock_locks'), pg_indexes_size('sqllock_locks') FROM sqllock_locks`).
		Scan(&rows, &table, &index)
	return rows, table, index, err
}

// measurePG runs r on PostgreSQL.
func (r rolling) measurePG(ctx context.Context, serverURL string) (rollFigures, error) {
	var f rollFigures
	ref, err := pgDB(ctx, serverURL, "rolling_ref")
	if err != nil {
		return f, err
	}
	defer ref.Close()
	if _, err := ref.Exec(ctx, acquireSQL, 0, r.live); err != nil {
		return f, fmt.Errorf("reference load: %w", err)
	}
	if _, err := ref.Exec(ctx, `VACUUM ANALYZE sqllock_locks`); err != nil {
		return f, err
	}
	if _, f.refTable, f.refIndex, err = pgSizes(ctx, ref); err != nil {
		return f, err
	}

	pool, err := pgDB(ctx, serverURL, "rolling")
	if err != nil {
		return f, err
	}
	defer pool.Close()
	b, err := postgres.New(pool, postgres.Options{})
	if err != nil {
		return f, err
	}
	defer b.Close()
	var lsn0, lsn1 string
	if err := pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&lsn0); err != nil {
		return f, err
	}
	begin := time.Now()
	for lo := 0; lo < r.n; lo += r.batch {
		hi := min(lo+r.batch, r.n)
		if _, err := pool.Exec(ctx, acquireSQL, lo, hi); err != nil {
			return f, fmt.Errorf("acquire %d..%d: %w", lo, hi, err)
		}
		if old := hi - r.live; old > 0 {
			if _, err := pool.Exec(ctx, releaseSQL, max(old-r.batch, 0), old); err != nil {
				return f, fmt.Errorf("release: %w", err)
			}
		}
		t := time.Now()
		n, err := sqllock.Reap(ctx, b, time.Hour)
		if err != nil {
			return f, err
		}
		f.reaped += n
		f.reapTime += time.Since(t)
		if _, err := pool.Exec(ctx, `VACUUM sqllock_locks`); err != nil {
			return f, err
		}
		_, table, index, err := pgSizes(ctx, pool)
		if err != nil {
			return f, err
		}
		f.peakTable, f.peakIndex = max(f.peakTable, table), max(f.peakIndex, index)
	}
	f.took = time.Since(begin)
	if err := pool.QueryRow(ctx, `SELECT pg_current_wal_lsn()::text`).Scan(&lsn1); err != nil {
		return f, err
	}
	if err := pool.QueryRow(ctx, `SELECT pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::bigint`, lsn1, lsn0).Scan(&f.walBytes); err != nil {
		return f, err
	}
	// The keys kept take their next token above everything: one check.
	l, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: key(0), TTL: time.Minute, Owner: "verify"})
	if err != nil {
		return f, err
	}
	if l.Token < 2 {
		return f, fmt.Errorf("reaped key %s: token %d, want at least 2", key(0), l.Token)
	}
	if err := b.Release(ctx, l); err != nil {
		return f, err
	}
	f.rows, f.tableBytes, f.indexBytes, err = pgSizes(ctx, pool)
	return f, err
}
