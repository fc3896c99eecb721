package postgres

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

func acquireOK(t *testing.T, b *Backend, key, owner string, ttl time.Duration) sqllock.Lease {
	t.Helper()
	l, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: key, TTL: ttl, Owner: owner})
	require.NoError(t, err)
	return l
}

// expire sets key's deadline into the past by the database clock, keeping
// its token and held flag.
func expire(t *testing.T, b *Backend, key string) {
	t.Helper()
	tag, err := adminPool(b).Exec(testCtx(t), "UPDATE "+b.table+" SET deadline = clock_timestamp() - interval '1 millisecond' WHERE key = $1", key)
	require.NoError(t, err)
	require.EqualValues(t, 1, tag.RowsAffected(), "expire(%q): no such key", key)
}

func TestNew(t *testing.T) {
	t.Parallel()

	for _, opts := range []Options{
		{Table: "bad-name"},
		{Table: `x"; DROP TABLE y; --`},
		{Schema: "1abc"},
		{Table: strings.Repeat("t", 64)},
		{Table: strings.Repeat("t", 56)}, // no room for "_version": never migratable
	} {
		_, err := New(&pgxpool.Pool{}, opts)
		require.Error(t, err, "%+v", opts)
	}
	_, err := New(nil, Options{})
	require.Error(t, err)

	b, err := New(&pgxpool.Pool{}, Options{Schema: "Mixed", Table: "select"})
	require.NoError(t, err)
	require.Equal(t, `"Mixed"."select"`, b.table)
	require.Contains(t, b.full.acquire, `INSERT INTO "Mixed"."select"`)
	require.Contains(t, b.full.channel, `'"Mixed"."select"'::regclass`)
}

func TestMicrosRoundsUp(t *testing.T) {
	t.Parallel()
	require.EqualValues(t, 1000, micros(time.Millisecond))
	require.EqualValues(t, 1001, micros(time.Millisecond+time.Nanosecond))
	require.EqualValues(t, 1, micros(time.Nanosecond))
	require.EqualValues(t, 86_400_000_000, micros(24*time.Hour))
}

// TestOptionsSchemaAndTable runs the basic cycle on a non-default schema and
// table whose names need quoting (mixed case, a keyword).
func TestOptionsSchemaAndTable(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{Schema: "Lock_Schema", Table: "select"})
	b := bundle.backend
	l := acquireOK(t, b, "k", "o1", time.Minute)
	_, err := b.TryAcquire(testCtx(t), sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o2"})
	require.ErrorIs(t, err, sqllock.ErrNotAcquired)
	ch, stop := b.Watch("k")
	defer stop()
	<-ch               // the listener is listening
	waiting(t, b, "k") // marks the lease, so its release notifies
	require.NoError(t, b.Release(testCtx(t), l))
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatal("no notification on a quoted schema and table")
	}
	infos, err := b.List(testCtx(t), "")
	require.NoError(t, err)
	require.Len(t, infos, 1)
}

// TestDeadlinesAreDatabaseTime checks that the deadline is the database's
// now + TTL rounded up to microseconds + 1µs (see leaseMicros), and that the same-owner retry
// extends it without a new token.
func TestDeadlinesAreDatabaseTime(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	// Long enough that the lease is surely still valid at the retry below.
	ttl := time.Hour + 1 // rounds up to 3600000001µs, +1µs
	l := acquireOK(t, b, "k", "o1", ttl)
	require.Equal(t, 3600000002*time.Microsecond, l.Deadline.Sub(l.BackendTime))
	var dbDeadline time.Time
	require.NoError(t, b.pool.QueryRow(testCtx(t), "SELECT deadline FROM "+b.table+" WHERE key = 'k'").Scan(&dbDeadline))
	require.True(t, dbDeadline.Equal(l.Deadline), "%v != %v", dbDeadline, l.Deadline)

	// The same owner's repeat keeps the token and extends the deadline to
	// now + TTL, but never moves it back (see queries.go): a repeat with a
	// shorter TTL keeps the later deadline.
	again := acquireOK(t, b, "k", "o1", ttl)
	require.Equal(t, l.Token, again.Token)
	require.Equal(t, 3600000002*time.Microsecond, again.Deadline.Sub(again.BackendTime))
	require.True(t, again.Deadline.After(l.Deadline))
	shorter := acquireOK(t, b, "k", "o1", time.Minute)
	require.Equal(t, l.Token, shorter.Token)
	require.True(t, shorter.Deadline.Equal(again.Deadline), "%v moved back to %v", again.Deadline, shorter.Deadline)
}

// countingTracer counts the statements a pool sends and the statements it
// prepares (a prepare is an extra round trip).
type countingTracer struct {
	queries, prepares atomic.Int64
}

func (c *countingTracer) TraceQueryStart(ctx context.Context, _ *pgx.Conn, _ pgx.TraceQueryStartData) context.Context {
	c.queries.Add(1)
	return ctx
}
func (c *countingTracer) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}
func (c *countingTracer) TracePrepareStart(ctx context.Context, _ *pgx.Conn, _ pgx.TracePrepareStartData) context.Context {
	c.prepares.Add(1)
	return ctx
}
func (c *countingTracer) TracePrepareEnd(context.Context, *pgx.Conn, pgx.TracePrepareEndData) {}

// TestOneRoundTripPerOperation counts what each operation sends on a
// one-connection pool once its statements are cached: exactly one statement
// and no prepare (pgx tracer), and exactly one round trip on the wire (a
// proxy counting Sync and Query messages), in every outcome.
func TestOneRoundTripPerOperation(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	cfg, err := pgxpool.ParseConfig(bundle.db.URL)
	require.NoError(t, err)
	proxy := newSyncCounter(t, net.JoinHostPort(cfg.ConnConfig.Host, strconv.Itoa(int(cfg.ConnConfig.Port))))
	host, port, err := net.SplitHostPort(proxy.addr())
	require.NoError(t, err)
	cfg.ConnConfig.Host = host
	p, err := strconv.Atoi(port)
	require.NoError(t, err)
	cfg.ConnConfig.Port = uint16(p)
	cfg.ConnConfig.Fallbacks = nil
	cfg.ConnConfig.TLSConfig = nil
	tracer := &countingTracer{}
	cfg.ConnConfig.Tracer = tracer
	cfg.MaxConns = 1
	cfg.ShouldPing = func(context.Context, pgxpool.ShouldPingParams) bool { return false }
	pool, err := pgxpool.NewWithConfig(testCtx(t), cfg)
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	b, err := New(pool, Options{})
	require.NoError(t, err)
	t.Cleanup(func() { b.Close() })
	ctx := testCtx(t)

	ops := []struct {
		name string
		fn   func() error
	}{}
	var l, stale sqllock.Lease
	add := func(name string, fn func() error) {
		ops = append(ops, struct {
			name string
			fn   func() error
		}{name, fn})
	}
	add("AcquireFree", func() (err error) {
		l, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o1"})
		return
	})
	add("AcquireHeld", func() error {
		_, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o2"})
		if !errors.Is(err, sqllock.ErrNotAcquired) {
			return fmt.Errorf("want held, got %v", err)
		}
		return nil
	})
	add("AcquireSameOwner", func() (err error) {
		l, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o1"})
		return
	})
	add("Renew", func() (err error) { l, err = b.TryRenew(ctx, l, time.Minute); return })
	add("RenewLost", func() error {
		stale = l
		stale.Token++
		if _, err := b.TryRenew(ctx, stale, time.Minute); !errors.Is(err, sqllock.ErrLeaseLost) {
			return fmt.Errorf("want lost, got %v", err)
		}
		return nil
	})
	add("Release", func() error { return b.Release(ctx, l) })
	add("ReleaseAgain", func() error { return b.Release(ctx, l) })
	add("List", func() error { _, err := b.List(ctx, "k"); return err })

	run := func(check bool) {
		for _, op := range ops {
			q, p, trips := tracer.queries.Load(), tracer.prepares.Load(), proxy.trips.Load()
			require.NoError(t, op.fn(), op.name)
			if check {
				require.EqualValues(t, 1, tracer.queries.Load()-q, "%s: statements sent", op.name)
				require.EqualValues(t, 0, tracer.prepares.Load()-p, "%s: prepares", op.name)
				require.EqualValues(t, 1, proxy.trips.Load()-trips, "%s: round trips on the wire", op.name)
			}
		}
	}
	run(false) // warm the statement cache of the pool's one connection
	// The proxy counts what it should: warming up prepared each of the four
	// statements once, in a round trip of its own, and the first statement
	// was preceded by the pooler check's one query (pooler.go), which
	// found the server itself.
	require.EqualValues(t, 4, tracer.prepares.Load())
	require.EqualValues(t, len(ops)+4+1, proxy.trips.Load(), "round trips while warming up")
	for range 3 {
		run(true)
	}
}

// TestFailedAcquireWritesNothing proves that a refused TryAcquire on a held
// key assigns no transaction id (so it locks no row, since row locks need
// one, and writes no commit record) and that no node of its plan writes
// WAL (EXPLAIN ANALYZE, WAL, which counts per statement, unlike the
// server-wide WAL position), beside a refused INSERT ... ON CONFLICT DO
// UPDATE ... WHERE that does both. The server-wide WAL written during
// refused attempts is logged for information only: other tests write too.
func TestFailedAcquireWritesNothing(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	b := bundle.backend
	ctx := testCtx(t)
	acquireOK(t, b, "hot", "holder", time.Hour)

	upsert := fmt.Sprintf(rawAcquireSQL, b.table) // as in the benchmarks
	args := []any{"hot", int64(60_000_000), "waiter"}

	// No transaction id, inside an explicit transaction: the Backend's
	// acquire statement runs on it (see tx_test.go).
	xidAfter := func(run func(tx pgx.Tx)) *int64 {
		tx, err := bundle.db.Pool.Begin(ctx)
		require.NoError(t, err)
		defer tx.Rollback(ctx)
		run(tx)
		var xid *int64
		require.NoError(t, tx.QueryRow(ctx, "SELECT pg_current_xact_id_if_assigned()::text::bigint").Scan(&xid))
		return xid
	}
	xid := xidAfter(func(tx pgx.Tx) {
		for i := range 10 {
			r := txAcquire(t, tx, b.full.acquire, sqllock.AcquireRequest{Key: "hot", TTL: time.Minute, Owner: fmt.Sprint("w", i)})
			require.False(t, r.granted)
			require.Equal(t, "holder", r.owner)
		}
	})
	require.Nil(t, xid, "a refused TryAcquire assigned a transaction id")
	xid = xidAfter(func(tx pgx.Tx) {
		rows, err := tx.Query(ctx, upsert, args...)
		require.NoError(t, err)
		require.False(t, rows.Next(), "the upsert granted a held key")
		rows.Close()
		require.NoError(t, rows.Err())
	})
	require.NotNil(t, xid, "control: a refused upsert should assign a transaction id")

	walOf := func(sql string, args ...any) (records, bytes int64) { return planWAL(t, b, sql, args...) }
	records, bytes := walOf(b.full.acquire, append(args, nil, int64(0))...)
	require.Zero(t, records, "a refused TryAcquire wrote WAL (%d bytes)", bytes)
	// Control: the count sees the statement's CTEs (a grant writes).
	records, _ = walOf(b.full.acquire, "free", int64(60_000_000), "w", nil, int64(0))
	require.Positive(t, records, "control: a granting TryAcquire should write WAL")
	records, bytes = walOf(upsert, args...)
	require.Positive(t, records, "control: a refused upsert should write WAL (a row lock)")
	t.Logf("WAL per refused attempt by plan nodes: TryAcquire 0 records, upsert %d records (%d bytes), plus its commit record", records, bytes)

	// Server-wide, for information.
	const n = 300
	walDuring := func(run func()) int64 {
		var before string
		require.NoError(t, b.pool.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn()::text").Scan(&before))
		run()
		var bytes int64
		require.NoError(t, b.pool.QueryRow(ctx, "SELECT pg_current_wal_insert_lsn() - $1::pg_lsn", before).Scan(&bytes))
		return bytes
	}
	ours := walDuring(func() {
		for i := range n {
			_, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "hot", TTL: time.Minute, Owner: fmt.Sprint("w", i)})
			require.ErrorIs(t, err, sqllock.ErrNotAcquired)
		}
	})
	theirs := walDuring(func() {
		for range n {
			_, err := b.pool.Exec(ctx, upsert, args...)
			require.NoError(t, err)
		}
	})
	t.Logf("server-wide WAL bytes during %d refused attempts (other tests included): TryAcquire %d, upsert %d", n, ours, theirs)
}

// planWAL runs sql under EXPLAIN (ANALYZE, WAL) and returns the WAL its
// plan wrote: records and bytes. A node's figures include those of the
// nodes it runs (a CTE scan runs its CTE), so the statement's total is the
// largest figure of any node, not their sum.
func planWAL(t *testing.T, b *Backend, sql string, args ...any) (records, bytes int64) {
	t.Helper()
	var plan []map[string]any
	require.NoError(t, b.pool.QueryRow(testCtx(t), "EXPLAIN (ANALYZE, WAL, FORMAT JSON) "+sql, args...).Scan(&plan))
	var walk func(node map[string]any)
	walk = func(node map[string]any) {
		r, _ := node["WAL Records"].(float64)
		by, _ := node["WAL Bytes"].(float64)
		records = max(records, int64(r))
		bytes = max(bytes, int64(by))
		children, _ := node["Plans"].([]any)
		for _, c := range children {
			walk(c.(map[string]any))
		}
	}
	require.Len(t, plan, 1)
	walk(plan[0]["Plan"].(map[string]any))
	return records, bytes
}

// TestRefusedAcquireWALWhileRenewed bounds what the README says of a
// refused acquire's WAL: it writes none of its own, but its read may prune
// the dead row versions that renewals leave on the lease's page (a heap
// page prune is logged), about once per hundred renewals. One refused
// attempt after each renewal; every record they write is counted.
func TestRefusedAcquireWALWhileRenewed(t *testing.T) {
	t.Parallel()
	b := newBundle(t, Options{}).backend
	ctx := testCtx(t)
	l := acquireOK(t, b, "hot", "holder", time.Hour)
	const renewals = 1000
	var records, bytes, attemptsThatWrote int64
	for range renewals {
		var err error
		l, err = b.TryRenew(ctx, l, time.Hour)
		require.NoError(t, err)
		r, by := planWAL(t, b, b.full.acquire, "hot", int64(60_000_000), "waiter", nil, int64(0))
		records += r
		bytes += by
		if r > 0 {
			attemptsThatWrote++
		}
	}
	t.Logf("RESULT test=TestRefusedAcquireWALWhileRenewed renewals=%d refused_attempts=%d attempts_that_wrote=%d wal_records=%d wal_bytes=%d",
		renewals, renewals, attemptsThatWrote, records, bytes)
	// README: about 1 record of under 300 bytes per 100 renewals. The
	// bound allows twice that.
	require.LessOrEqual(t, records, int64(renewals/50), "refused attempts wrote more WAL records than the README says")
	require.LessOrEqual(t, bytes, records*600, "a record larger than the README says")
}

// TestSynchronousCommitPerStatement checks, inside a transaction, that
// Release (and only Release) turns synchronous_commit off for its own
// transaction (see queries/release.sql for why a release needs no flush), and that
// every grant (acquire.sql's insert and update arms) and renewal turns it on
// from off (a session, role or database may have it off): each statement
// runs in a transaction of its own that starts with the setting it must
// change, so that none of them can pass on another's setting.
func TestSynchronousCommitPerStatement(t *testing.T) {
	t.Parallel()
	for _, opts := range []Options{{}, {DisableNotify: true}, {DurableRelease: true}} {
		bundle := newBundle(t, opts)
		ctx := testCtx(t)
		conn, err := bundle.db.Pool.Acquire(ctx)
		require.NoError(t, err)
		defer conn.Release()
		setting := func(q interface {
			QueryRow(context.Context, string, ...any) pgx.Row
		}) string {
			var s string
			require.NoError(t, q.QueryRow(ctx, "SHOW synchronous_commit").Scan(&s))
			return s
		}
		session := setting(conn) // test servers may run with it off
		b, err := New(bundle.db.Pool, opts)
		require.NoError(t, err)
		// inTx runs fn in a transaction of its own that starts with
		// synchronous_commit at from, and returns the setting fn left.
		inTx := func(from string, fn func(tx pgx.Tx)) string {
			tx, err := conn.Begin(ctx)
			require.NoError(t, err)
			defer tx.Rollback(ctx)
			_, err = tx.Exec(ctx, "SET LOCAL synchronous_commit = "+from)
			require.NoError(t, err)
			fn(tx)
			s := setting(tx)
			require.NoError(t, tx.Commit(ctx))
			return s
		}
		req := sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o1"}
		var l sqllock.Lease
		require.Equal(t, "on", inTx("off", func(tx pgx.Tx) {
			r := txAcquire(t, tx, b.full.acquire, req)
			require.True(t, r.granted)
			require.EqualValues(t, 1, r.token, "the key's first grant (the insert arm)")
			l = sqllock.Lease{Key: "k", Token: r.token, Owner: "o1"}
		}), "a grant by the insert arm must commit synchronously")
		require.Equal(t, "on", inTx("off", func(tx pgx.Tx) {
			renewed, _ := txRenew(t, tx, b, l, time.Minute)
			require.True(t, renewed)
		}), "a renewal must commit synchronously")
		release := func(tx pgx.Tx) { require.True(t, txRelease(t, tx, b, l)) }
		if opts.DurableRelease {
			require.Equal(t, "on", inTx("off", release), "DurableRelease must commit synchronously")
		} else {
			require.Equal(t, "off", inTx("on", release))
		}
		require.Equal(t, "on", inTx("off", func(tx pgx.Tx) {
			r := txAcquire(t, tx, b.full.acquire, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o2"})
			require.True(t, r.granted)
			require.EqualValues(t, 2, r.token, "a new tenure of a released key (the update arm)")
		}), "a grant by the update arm must commit synchronously")
		require.Equal(t, session, setting(conn), "the setting leaked out of the transaction")
	}
}
