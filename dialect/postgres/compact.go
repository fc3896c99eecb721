package postgres

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

var _ sqllock.Compactor = (*Backend)(nil)

// ErrNotOwner is returned by [Backend.Compact] for a role that does not
// own the lock table: VACUUM skips such a table and REINDEX refuses it.
var ErrNotOwner = errors.New("sqllock/postgres: compacting the lock table needs its owner's rights")

// The moves' bounds: rows per transaction (each holds its rows locked for
// one DO block, as a reap holds its batch for one statement), rounds of
// updates per transaction (a round that leaves a row on its page takes at
// least that row's size of the page's room, so a page of 8 KiB is left
// within a few hundred rounds by rows of any size), and the milliseconds
// a transaction's rounds may take: a renewal or release of a row it holds
// waits that long at most.
const (
	compactBatch  = 64
	compactRounds = 400
	compactMillis = 50
)

// compactSchema is what the compaction's statements (queries/compact_*.sql)
// are rendered for.
type compactSchema struct {
	Table                      string // quoted
	Cut, Batch, Rounds, Millis int64
}

// Compact implements [sqllock.Compactor], on the pgx pool or the *sql.DB
// alike:
//
//  1. VACUUM (INDEX_CLEANUP ON): the reaped rows' space goes into the free
//     space map, whose search then starts from the table's first page;
//  2. the rows' bytes give the pages they need; a cut half as many again
//     above that (queries/compact_measure.sql);
//  3. the rows at or past the cut are moved toward the start, in
//     transactions of compactBatch rows locked SKIP LOCKED
//     (queries/compact_move.sql), while a pass leaves fewer rows there;
//  4. VACUUM (INDEX_CLEANUP ON) again: the old versions go, and the pages
//     at the end, now empty, are truncated. (A plain VACUUM, and
//     autovacuum, skip the index pass when few pages have dead rows, and
//     then keep their line pointers: the pages are not empty and stay.)
//     Its truncation takes an ACCESS EXCLUSIVE lock only when it gets it
//     at once, and gives it up as soon as another session waits, as
//     autovacuum's does;
//  5. REINDEX INDEX CONCURRENTLY of each of the table's indexes: a b-tree
//     never gives its empty pages back, a rebuild holds only the live
//     keys. It writes nothing of the rows and blocks no acquire, but it
//     waits for the transactions older than it. One that fails leaves an
//     invalid index behind ("_ccnew", or "_ccold" when it failed after the
//     swap), which Compact drops (and, at its start, any an earlier one
//     left while no rebuild of the table runs).
//
// None of the statements takes a bind parameter (a DO block cannot, and
// the rest are the catalog's and PostgreSQL's own commands on the table's
// validated, quoted name), and each is its own transaction; on the pgx
// pool they go in the simple protocol, so that they pass a pooler in
// transaction mode too.
func (b *Backend) Compact(ctx context.Context) (sqllock.CompactStats, error) {
	var cs sqllock.CompactStats
	if _, err := b.statements(ctx, outcome.Compact, ""); err != nil {
		return cs, err
	}
	s := compactSchema{Table: b.table, Batch: compactBatch, Rounds: compactRounds, Millis: compactMillis}
	var owner bool
	if err := b.maintRow(ctx, fmt.Sprintf(`SELECT pg_has_role(c.relowner, 'USAGE') FROM pg_class AS c WHERE c.oid = '%s'::regclass`, b.table), &owner); err != nil {
		return cs, b.compactError(ctx, "reading the table's owner", err)
	}
	if !owner {
		return cs, fmt.Errorf("%w: %s (VACUUM and REINDEX of a table are its owner's); nothing was moved", ErrNotOwner, b.table)
	}
	if err := b.dropLeftIndexes(ctx, true); err != nil {
		return cs, err
	}
	if err := b.vacuum(ctx); err != nil {
		return cs, err
	}
	measure := fillCompact("compact_measure", s)
	var live, pages, block int64
	if err := b.maintRow(ctx, measure, &cs.Rows, &live, &pages, &block, &cs.TableBytes[0], &cs.IndexBytes[0]); err != nil {
		return cs, b.compactError(ctx, "measuring", err)
	}
	need := (live + block - 25) / (block - 24) // the page header is 24 bytes
	s.Cut = need + need/2 + 1
	if pages > s.Cut {
		if err := b.moveRows(ctx, s, &cs); err != nil {
			return cs, err
		}
	}
	if err := b.vacuum(ctx); err != nil {
		return cs, err
	}
	indexes, err := b.indexNames(ctx, "i.indisvalid")
	if err != nil {
		return cs, err
	}
	for _, ix := range indexes {
		if err := b.maintExec(ctx, "REINDEX INDEX CONCURRENTLY "+ix); err != nil {
			rerr := b.compactError(ctx, "rebuilding index "+ix, err)
			// A rebuild that failed leaves its new index behind, invalid
			// but kept up to date by every write: drop it, even when ctx
			// has ended. The drop waits for the transactions that hold the
			// table (the one the rebuild waited for, perhaps): past
			// horizonWait the next Compact drops it.
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), horizonWait)
			defer cancel()
			if derr := b.dropLeftIndexes(dctx, false); derr != nil {
				return cs, errors.Join(rerr, derr)
			}
			return cs, rerr
		}
	}
	if err := b.maintRow(ctx, measure, &cs.Rows, &live, &pages, &block, &cs.TableBytes[1], &cs.IndexBytes[1]); err != nil {
		return cs, b.compactError(ctx, "measuring", err)
	}
	return cs, nil
}

// vacuum is VACUUM (INDEX_CLEANUP ON) of the table, once no older
// transaction keeps what it would remove (waitHorizon).
func (b *Backend) vacuum(ctx context.Context) error {
	if err := b.waitHorizon(ctx); err != nil {
		return err
	}
	if err := b.maintExec(ctx, "VACUUM (INDEX_CLEANUP ON) "+b.table); err != nil {
		return b.compactError(ctx, "vacuuming", err)
	}
	return nil
}

// moveRows moves the rows at or past page s.Cut toward the table's start
// (queries/compact_move.sql), a batch at a time while a pass leaves fewer
// of them there, and counts them into cs.
func (b *Backend) moveRows(ctx context.Context, s compactSchema, cs *sqllock.CompactStats) error {
	left := fillCompact("compact_left", s)
	var before int64
	if err := b.maintRow(ctx, left, &before); err != nil {
		return b.compactError(ctx, "counting the rows to move", err)
	}
	move := fillCompact("compact_move", s)
	retried := false
	for now := before; now > 0; {
		if err := b.maintExec(ctx, move); err != nil {
			return b.compactError(ctx, "moving rows", err)
		}
		was := now
		if err := b.maintRow(ctx, left, &now); err != nil {
			return b.compactError(ctx, "counting the rows to move", err)
		}
		cs.Left = now
		cs.Moved = max(before-now, 0)
		if now < was {
			continue
		}
		if retried {
			break // the rest is locked by others, or found no room
		}
		// No room found: perhaps the VACUUM could not yet free what a
		// transaction it waited for could still see. Once more.
		retried = true
		if err := b.vacuum(ctx); err != nil {
			return err
		}
	}
	return nil
}

// indexNames are the table's indexes that cond (on pg_index i and pg_class
// c, the index's) selects, schema-qualified and quoted.
func (b *Backend) indexNames(ctx context.Context, cond string) ([]string, error) {
	q := fmt.Sprintf(`SELECT coalesce(json_agg(format('%%I.%%I', n.nspname, c.relname) ORDER BY i.indexrelid), '[]')::text
FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid JOIN pg_namespace AS n ON n.oid = c.relnamespace
WHERE i.indrelid = '%s'::regclass AND %s`, b.table, cond)
	var names string
	if err := b.maintRow(ctx, q, &names); err != nil {
		return nil, b.compactError(ctx, "listing the indexes", err)
	}
	var ix []string
	if err := json.Unmarshal([]byte(names), &ix); err != nil {
		return nil, fmt.Errorf("sqllock/postgres: compact %s: the indexes' names: %w", b.table, err)
	}
	return ix, nil
}

// horizonWait bounds how long Compact waits for the transactions older
// than its last step (waitHorizon).
const horizonWait = 2 * time.Second

// waitHorizon waits, up to horizonWait, until no client session of the
// database keeps a snapshot, or a transaction id, from before now: until
// then VACUUM keeps the row versions that the reap deleted and that the
// moves left (they may still be visible to it), so it can neither hand
// their room to the moves nor truncate the table's end. Past that bound
// Compact goes on with what VACUUM can do (a transaction left open keeps
// its rows' old versions: the next Compact takes them). What else holds
// VACUUM back (a replication slot, a standby's feedback, a prepared
// transaction) it does not wait for.
func (b *Backend) waitHorizon(ctx context.Context) error {
	var mark string // the next transaction id now, as a 32-bit xid
	if err := b.maintRow(ctx, `SELECT (pg_snapshot_xmax(pg_current_snapshot())::text::bigint % 4294967296)::text`, &mark); err != nil {
		return b.compactError(ctx, "reading the transaction counter", err)
	}
	q := fmt.Sprintf(`SELECT count(*) FROM pg_stat_activity
WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'
  AND greatest(age(backend_xmin), age(backend_xid)) > age('%s'::xid)`, mark)
	deadline := time.Now().Add(horizonWait)
	for {
		var older int
		if err := b.maintRow(ctx, q, &older); err != nil {
			return b.compactError(ctx, "looking for older transactions", err)
		}
		if older == 0 || time.Now().After(deadline) {
			return nil
		}
		select {
		case <-ctx.Done():
			return b.compactError(ctx, "waiting for older transactions", ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// dropLeftIndexes drops the invalid indexes that a failed REINDEX
// CONCURRENTLY of the table left (named after the index, "_ccnew" or,
// failed after the swap, "_ccold", and a number). idle: only while no index build of the table is in progress,
// since a rebuild that runs has one of those too.
func (b *Backend) dropLeftIndexes(ctx context.Context, idle bool) error {
	cond := `NOT i.indisvalid AND c.relname ~ '_cc(new|old)[0-9]*$'`
	if idle {
		cond += ` AND NOT EXISTS (SELECT FROM pg_stat_progress_create_index AS p WHERE p.relid = i.indrelid)`
	}
	left, err := b.indexNames(ctx, cond)
	if err != nil {
		return err
	}
	for _, ix := range left {
		if err := b.maintExec(ctx, "DROP INDEX CONCURRENTLY IF EXISTS "+ix); err != nil {
			return fmt.Errorf("%w (the invalid index %s slows every write to the table: the next Compact drops it, or DROP INDEX CONCURRENTLY it)",
				b.compactError(ctx, "dropping index "+ix+" that a failed rebuild left", err), ix)
		}
	}
	return nil
}

// compactError is err of Compact's step, translated as any statement's.
func (b *Backend) compactError(ctx context.Context, step string, err error) error {
	return fmt.Errorf("%s: %w", step, b.translate(ctx, outcome.Compact, "", err))
}

// maintExec sends q, a statement without parameters and without rows, on
// the pool or the *sql.DB, in the simple protocol (VACUUM and REINDEX
// CONCURRENTLY run outside a transaction block).
func (b *Backend) maintExec(ctx context.Context, q string) error {
	if b.db != nil {
		_, err := b.db.ExecContext(ctx, q)
		return err
	}
	_, err := b.pool.Exec(ctx, q, pgx.QueryExecModeSimpleProtocol)
	return err
}

// maintRow is maintExec for a statement of one row, scanned into dest.
func (b *Backend) maintRow(ctx context.Context, q string, dest ...any) error {
	if b.db != nil {
		return b.db.QueryRowContext(ctx, q).Scan(dest...)
	}
	return b.pool.QueryRow(ctx, q, pgx.QueryExecModeSimpleProtocol).Scan(dest...)
}

// fillCompact renders the compaction's statement in queries/name.sql.
func fillCompact(name string, s compactSchema) string {
	var sb strings.Builder
	if err := queryTemplates.ExecuteTemplate(&sb, name+".sql", s); err != nil {
		panic(err) // the templates are the package's own: TestCompact renders each
	}
	return sb.String()
}
