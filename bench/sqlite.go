package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/ashlock/ashlock/dialect/sqlite"
	"github.com/ashlock/ashlock/migrations"
)

// The design's two statements on SQLite, as the backend's clock expression
// computes them (integer Unix milliseconds), on a table with the same
// schema as the backend's: migration 00002's trigger refuses an insert
// whose token is below the row's, which SQLite checks for an upsert too, so
// the insert carries the row's current token, as the backend's does.
const (
	sqliteNow        = `CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER)`
	sqliteRawAcquire = `
INSERT INTO raw_locks (key, token, held, deadline, owner)
VALUES (?1, coalesce((SELECT token FROM raw_locks WHERE key = ?1), 1), 1, $NOW + ?2, ?3)
ON CONFLICT (key) DO UPDATE SET token = token + 1, held = 1, deadline = excluded.deadline, owner = excluded.owner
WHERE NOT held OR deadline <= $NOW
RETURNING token`
	sqliteRawRelease = `UPDATE raw_locks SET held = 0 WHERE key = ?1 AND token = ?2`
)

func sqliteRawContender(name string, db *sql.DB, keys []string) (contender, error) {
	acq, err := db.Prepare(strings.ReplaceAll(sqliteRawAcquire, "$NOW", sqliteNow))
	if err != nil {
		return contender{}, err
	}
	rel, err := db.Prepare(sqliteRawRelease)
	if err != nil {
		return contender{}, err
	}
	return contender{name: name, newWorker: func(id int, rng *rand.Rand) pairFunc {
		owner := fmt.Sprintf("raw-%d", id)
		return func(ctx context.Context) (bool, error) {
			key := keys[rng.IntN(len(keys))]
			var token int64
			err := acq.QueryRowContext(ctx, key, int64(30000), owner).Scan(&token)
			if errors.Is(err, sql.ErrNoRows) {
				return false, nil
			}
			if err != nil {
				return false, err
			}
			_, err = rel.ExecContext(ctx, key, token)
			return true, err
		}
	}}, nil
}

// flockContender locks one of 256 files with flock(2) (LOCK_EX|LOCK_NB) and
// unlocks it. Each goroutine has its own open file descriptions, so
// goroutines contend as processes would.
func flockContender(dir string) (contender, error) {
	const files = 256
	for i := range files {
		f, err := os.OpenFile(filepath.Join(dir, fmt.Sprintf("flock-%03d", i)), os.O_CREATE|os.O_RDWR, 0o644)
		if err != nil {
			return contender{}, err
		}
		f.Close()
	}
	return contender{name: "flock", newWorker: func(id int, rng *rand.Rand) pairFunc {
		fds := make([]int, files)
		for i := range fds {
			fd, err := syscall.Open(filepath.Join(dir, fmt.Sprintf("flock-%03d", i)), syscall.O_RDWR|syscall.O_CLOEXEC, 0)
			if err != nil {
				return func(context.Context) (bool, error) { return false, err }
			}
			fds[i] = fd
		}
		return func(ctx context.Context) (bool, error) {
			fd := fds[rng.IntN(files)]
			if err := syscall.Flock(fd, syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
				if errors.Is(err, syscall.EWOULDBLOCK) {
					return false, nil
				}
				return false, err
			}
			return true, syscall.Flock(fd, syscall.LOCK_UN)
		}
	}}, nil
}

// sqliteMatrix builds the SQLite matrix; stats reports, after the run, how
// often each ashlock backend retried a busy database.
func sqliteMatrix(ctx context.Context, cfg *config, tmp string) (m *matrix, stats func() map[string]uint64, err error) {
	keys := make([]string, cfg.keys)
	for i := range keys {
		keys[i] = fmt.Sprintf("k%05d", i)
	}
	var cs []contender
	backends := map[string]*sqlite.Backend{}
	for _, sync := range []sqlite.Synchronous{sqlite.SynchronousFull, sqlite.SynchronousNormal} {
		opts := sqlite.Options{Synchronous: sync}
		b, err := sqlite.Open(filepath.Join(tmp, "ashlock-"+string(sync)+".db"), opts)
		if err != nil {
			return nil, nil, err
		}
		cs = append(cs, backendContender("ashlock-"+string(sync), b, keys, defaultTTL))
		backends["ashlock-"+string(sync)] = b
		dsn, err := sqlite.DSN(filepath.Join(tmp, "raw-"+string(sync)+".db"), opts)
		if err != nil {
			return nil, nil, err
		}
		db, err := sql.Open("sqlite", dsn)
		if err != nil {
			return nil, nil, err
		}
		db.SetMaxOpenConns(1) // as sqlite.Open: one connection per process
		if err := migrations.Up(ctx, migrations.SQLite, db, migrations.Options{Table: "raw_locks"}); err != nil {
			return nil, nil, err
		}
		c, err := sqliteRawContender("raw-"+string(sync), db, keys)
		if err != nil {
			return nil, nil, err
		}
		cs = append(cs, c)
		// Released rows for every key, as on PostgreSQL.
		if err := sqliteFill(ctx, db, "raw_locks", keys); err != nil {
			return nil, nil, err
		}
		adsn, err := sqlite.DSN(filepath.Join(tmp, "ashlock-"+string(sync)+".db"), opts)
		if err != nil {
			return nil, nil, err
		}
		adb, err := sql.Open("sqlite", adsn)
		if err != nil {
			return nil, nil, err
		}
		err = sqliteFill(ctx, adb, migrations.DefaultTable, keys)
		adb.Close()
		if err != nil {
			return nil, nil, err
		}
	}
	fl, err := flockContender(tmp)
	if err != nil {
		return nil, nil, err
	}
	cs = append(cs, fl)
	stats = func() map[string]uint64 {
		out := map[string]uint64{}
		for name, b := range backends {
			out[name] = b.Stats().BusyRetries
			b.Close()
		}
		return out
	}
	return &matrix{section: "sqlite", contenders: cs, conc: []int{1, 4}, rounds: cfg.rounds, dur: cfg.dur / 2, latency: true, warmup: cfg.warmup()}, stats, nil
}

func sqliteFill(ctx context.Context, db *sql.DB, table string, keys []string) error {
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		return err
	}
	for _, k := range keys {
		if _, err := tx.ExecContext(ctx, `INSERT INTO `+table+` (key, token, held, deadline, owner) VALUES (?1, 1, 0, 0, '')`, k); err != nil {
			tx.Rollback()
			return err
		}
	}
	return tx.Commit()
}
