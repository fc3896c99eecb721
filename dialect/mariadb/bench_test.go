package mariadb

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ashlock/ashlock/internal/testkit/mariatest"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// The two statements a hand-written MariaDB lock would send, on a table
// of the backend's schema (triggers included): a grant-if-free upsert that
// returns the token and owner, and a release by key and token. No min
// hold, no value, no same-owner repeat, no loss reasons.
const (
	rawAcquire = "INSERT INTO raw_locks (`key`, token, held, deadline, owner) VALUES (?, 1, 1, UTC_TIMESTAMP(6) + INTERVAL ? MICROSECOND, ?)\n" +
		"ON DUPLICATE KEY UPDATE\n" +
		"\ttoken = token + IF(LAST_INSERT_ID(NOT held OR deadline <= UTC_TIMESTAMP(6)), 1, 0),\n" +
		"\tdeadline = IF(LAST_INSERT_ID(), VALUES(deadline), deadline),\n" +
		"\towner = IF(LAST_INSERT_ID(), VALUES(owner), owner),\n" +
		"\theld = 1\n" +
		"RETURNING token, owner"
	rawRelease = "UPDATE raw_locks SET held = 0 WHERE `key` = ? AND token = ? AND held"
)

// BenchmarkPairs measures TryAcquire+Release pairs on random keys (10,000
// of them, each with a released row) through the Backend, and the raw
// statements above through the same server, at 1 to 64 goroutines; each
// sub-benchmark reports pairs/s (target: the backend at least 0.9× raw):
//
//	SQLLOCK_REQUIRE_MARIADB=1 go test -run '^$' -bench Pairs -count 3 ./dialect/mariadb
func BenchmarkPairs(b *testing.B) {
	s := mariatest.Server(b)
	name := mariatest.Database(b, s)
	db := mariatest.Open(b, s.Addr, name)
	db.SetMaxOpenConns(80)
	db.SetMaxIdleConns(80)
	ctx := context.Background()
	if err := migrations.Up(ctx, migrations.MariaDB, db, migrations.Options{}); err != nil {
		b.Fatal(err)
	}
	if err := migrations.Up(ctx, migrations.MariaDB, db, migrations.Options{Table: "raw_locks"}); err != nil {
		b.Fatal(err)
	}
	be, err := New(db, Options{})
	if err != nil {
		b.Fatal(err)
	}
	defer be.Close()
	keys := make([]string, 10_000)
	for i := range keys {
		keys[i] = "bench/" + strconv.Itoa(i)
	}
	for _, table := range []string{"sqllock_locks", "raw_locks"} {
		for i := 0; i < len(keys); i += 1000 {
			q := "INSERT INTO " + table + " (`key`, token, held, deadline, owner) VALUES "
			var args []any
			for j, k := range keys[i : i+1000] {
				if j > 0 {
					q += ","
				}
				q += "(?, 1, 0, UTC_TIMESTAMP(6), '')"
				args = append(args, k)
			}
			if _, err := db.ExecContext(ctx, q, args...); err != nil {
				b.Fatal(err)
			}
		}
	}
	acq, err := db.PrepareContext(ctx, rawAcquire)
	if err != nil {
		b.Fatal(err)
	}
	defer acq.Close()
	rel, err := db.PrepareContext(ctx, rawRelease)
	if err != nil {
		b.Fatal(err)
	}
	defer rel.Close()

	const ttl = 30 * time.Second
	var owners atomic.Int64
	owner := func() string { return "o" + strconv.FormatInt(owners.Add(1), 10) }
	viaBackend := func() error {
		l, err := be.TryAcquire(ctx, sqllock.AcquireRequest{Key: keys[rand.N(len(keys))], TTL: ttl, Owner: owner()})
		if errors.Is(err, sqllock.ErrNotAcquired) {
			return nil // two goroutines drew the same key
		}
		if err != nil {
			return err
		}
		return be.Release(ctx, l)
	}
	viaRaw := func() error {
		key, me := keys[rand.N(len(keys))], owner()
		var token int64
		var o string
		if err := acq.QueryRowContext(ctx, key, int64(ttl/time.Microsecond), me).Scan(&token, &o); err != nil {
			return err
		}
		if o != me {
			return nil
		}
		_, err := rel.ExecContext(ctx, key, token)
		return err
	}
	for _, g := range []int{1, 4, 16, 64} {
		for _, c := range []struct {
			name string
			pair func() error
		}{{"ashlock", viaBackend}, {"raw", viaRaw}} {
			b.Run(fmt.Sprintf("goroutines=%d/%s", g, c.name), func(b *testing.B) {
				var next atomic.Int64
				var wg sync.WaitGroup
				var failed atomic.Value
				start := time.Now()
				for range g {
					wg.Go(func() {
						for next.Add(1) <= int64(b.N) {
							if err := c.pair(); err != nil {
								failed.Store(err)
								return
							}
						}
					})
				}
				wg.Wait()
				if err, ok := failed.Load().(error); ok {
					b.Fatal(err)
				}
				b.ReportMetric(float64(b.N)/time.Since(start).Seconds(), "pairs/s")
			})
		}
	}
}
