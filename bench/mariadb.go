package main

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"

	"github.com/go-sql-driver/mysql"

	"github.com/ashlock/ashlock/dialect/mariadb"
	"github.com/ashlock/ashlock/internal/testkit/mariaserver"
	"github.com/ashlock/ashlock/migrations"
)

var mariadbRatios = [][2]string{{"backend", "raw"}, {"backend-session", "raw"}, {"backend-session-nogc", "raw"}, {"raw-lockwait", "raw"}}

// The two statements a hand-written MariaDB lock would send, on a table of
// the backend's schema (its triggers included): a grant-if-free upsert that
// returns the token and owner, and a release by key and token. No min
// hold, no value, no same-owner repeat, no loss reasons.
const (
	mariadbRawAcquire = "INSERT INTO raw_locks (`key`, token, held, deadline, owner) VALUES (?, 1, 1, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ?)\n" +
		"ON DUPLICATE KEY UPDATE\n" +
		"\ttoken = token + IF(LAST_INSERT_ID(NOT held OR deadline <= UTC_TIMESTAMP(6)), 1, 0),\n" +
		"\tdeadline = IF(LAST_INSERT_ID(), VALUES(deadline), deadline),\n" +
		"\towner = IF(LAST_INSERT_ID(), VALUES(owner), owner),\n" +
		"\theld = 1\n" +
		"RETURNING token, owner"
	mariadbRawRelease = "UPDATE raw_locks SET held = 0 WHERE `key` = ? AND token = ? AND held"
	// mariadbLockWait is the prefix the backend puts before each statement
	// (its default Options.LockWait, 5s): raw-lockwait sends the raw
	// statements under it, to show what bounding the lock wait costs.
	mariadbLockWait = "SET STATEMENT innodb_lock_wait_timeout = 5 FOR "
)

// mariadbEnv is the section's server: started from the machine's binaries,
// durable (innodb_flush_log_at_trx_commit=1, the backend's advice).
type mariadbEnv struct {
	s *mariaserver.Server
	// db is the pool of the raw statements and of the backend that sets
	// its lock wait with each statement; sessionDB's DSN sets it for the
	// session (innodb_lock_wait_timeout=5, the backend's default), so that
	// the backend on it sends none.
	db, sessionDB *sql.DB
	version       string
}

func startMariaDB(ctx context.Context) (*mariadbEnv, error) {
	s, err := mariaserver.Start(mariaserver.Options{Durable: true})
	if err != nil {
		return nil, fmt.Errorf("mariadb: %w", err)
	}
	e := &mariadbEnv{s: s}
	c := mysql.NewConfig()
	c.User, c.Net, c.Addr = "root", "tcp", s.Addr
	admin, err := sql.Open("mysql", c.FormatDSN())
	if err != nil {
		e.close()
		return nil, err
	}
	defer admin.Close()
	if _, err := admin.ExecContext(ctx, "CREATE DATABASE bench"); err != nil {
		e.close()
		return nil, err
	}
	if err := admin.QueryRowContext(ctx, "SELECT VERSION()").Scan(&e.version); err != nil {
		e.close()
		return nil, err
	}
	c.DBName = "bench"
	c.Params = map[string]string{"tx_isolation": "'READ-COMMITTED'"}
	if e.db, err = sql.Open("mysql", c.FormatDSN()); err != nil {
		e.close()
		return nil, err
	}
	e.db.SetMaxOpenConns(80)
	e.db.SetMaxIdleConns(80)
	c.Params["innodb_lock_wait_timeout"] = "5"
	if e.sessionDB, err = sql.Open("mysql", c.FormatDSN()); err != nil {
		e.close()
		return nil, err
	}
	e.sessionDB.SetMaxOpenConns(80)
	e.sessionDB.SetMaxIdleConns(80)
	return e, nil
}

func (e *mariadbEnv) close() {
	if e.db != nil {
		e.db.Close()
	}
	if e.sessionDB != nil {
		e.sessionDB.Close()
	}
	e.s.Close(false)
}

// matrix: the Backend and the raw statements, both on tables of the
// backend's schema with a released row for every key.
func (e *mariadbEnv) matrix(ctx context.Context, cfg *config) (*matrix, error) {
	keys := make([]string, cfg.keys)
	for i := range keys {
		keys[i] = fmt.Sprintf("k%05d", i)
	}
	for _, table := range []string{migrations.DefaultTable, "raw_locks"} {
		if err := migrations.Up(ctx, migrations.MariaDB, e.db, migrations.Options{Table: table}); err != nil {
			return nil, err
		}
		for i := 0; i < len(keys); i += 1000 {
			chunk := keys[i:min(i+1000, len(keys))]
			args := make([]any, len(chunk))
			for j, k := range chunk {
				args[j] = k
			}
			q := "INSERT INTO " + table + " (`key`, token, held, deadline, owner) VALUES " +
				strings.TrimSuffix(strings.Repeat("(?, 1, 0, UTC_TIMESTAMP(6), ''),", len(chunk)), ",")
			if _, err := e.db.ExecContext(ctx, q, args...); err != nil {
				return nil, err
			}
		}
	}
	b, err := mariadb.New(e.db, mariadb.Options{})
	if err != nil {
		return nil, err
	}
	bs, err := mariadb.New(e.sessionDB, mariadb.Options{})
	if err != nil {
		return nil, err
	}
	bn, err := mariadb.New(e.sessionDB, mariadb.Options{DisableGroupCommit: true})
	if err != nil {
		return nil, err
	}
	raw, err := e.rawContender(ctx, "raw", "", keys)
	if err != nil {
		return nil, err
	}
	rawWait, err := e.rawContender(ctx, "raw-lockwait", mariadbLockWait, keys)
	if err != nil {
		return nil, err
	}
	cs := []contender{backendContender("backend", b, keys, defaultTTL), backendContender("backend-session", bs, keys, defaultTTL),
		backendContender("backend-session-nogc", bn, keys, defaultTTL), raw, rawWait}
	return &matrix{section: "mariadb", contenders: cs, conc: cfg.conc, rounds: cfg.rounds, dur: cfg.dur, latency: true, warmup: cfg.warmup()}, nil
}

// rawContender sends the raw statements, each after prefix, on random keys.
func (e *mariadbEnv) rawContender(ctx context.Context, name, prefix string, keys []string) (contender, error) {
	acq, err := e.db.PrepareContext(ctx, prefix+mariadbRawAcquire)
	if err != nil {
		return contender{}, err
	}
	rel, err := e.db.PrepareContext(ctx, prefix+mariadbRawRelease)
	if err != nil {
		return contender{}, err
	}
	return contender{name: name, newWorker: func(id int, rng *rand.Rand) pairFunc {
		owner := fmt.Sprintf("%s-%d", name, id)
		return func(ctx context.Context) (bool, error) {
			key := keys[rng.IntN(len(keys))]
			var token int64
			var o string
			err := acq.QueryRowContext(ctx, key, int64(defaultTTL.Microseconds()), owner).Scan(&token, &o)
			if errors.Is(err, sql.ErrNoRows) || err == nil && o != owner {
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

func (r *Report) mariadbMarkdown(w func(string, ...any), gs []int) {
	w("\n## MariaDB: TryAcquire + Release pairs/s\n\nOne MariaDB %s started from the machine's binaries (innodb_flush_log_at_trx_commit=1, READ COMMITTED), random keys with released rows; the raw contender sends a hand-written grant-if-free upsert and an UPDATE release, on a table of the same schema, through the same pool.\n\n| contender | %s |\n|---|%s\n", r.MariaDBVersion, cols(gs, "", false), strings.Repeat("--:|", len(gs)))
	for _, c := range []string{"raw", "raw-lockwait", "backend", "backend-session", "backend-session-nogc"} {
		w("| %s |", name("mariadb", c))
		for _, g := range gs {
			cell, _ := r.cell("mariadb", c, g)
			if c == "raw" {
				w(" %s |", num(cell.OpsPerSec))
			} else {
				w(" %s (%s) |", num(cell.OpsPerSec), ratioStr(r.ratio("mariadb", c, "raw", g)))
			}
		}
		w("\n")
	}
	w("\nIn parentheses: the ratio to the raw statements, same rounds (target ≥ 0.9×). raw-lockwait is the raw statements under the backend's `SET STATEMENT innodb_lock_wait_timeout = 5 FOR` prefix (its Options.LockWait): what bounding a statement's row-lock wait costs by itself; the backend pays it unless the session has its lock wait already: backend-session is the same backend on a pool whose DSN sets innodb_lock_wait_timeout=5 (as the CLI's does), so that no statement carries the prefix. Both coalesce concurrent acquires (group commit, the default); backend-session-nogc is backend-session with DisableGroupCommit.\n")
}
