package sqllock

import "context"

// Compactor is implemented by backends whose storage keeps the space of
// reaped rows after a reap until the table is rewritten: PostgreSQL's
// VACUUM returns to the operating system only the empty pages at the end
// of a table, and never a b-tree index's pages, so a table that held a
// million keys once keeps their size after they were reaped (rows that
// are still live sit in its last pages). Compact brings the table and its
// index back near the size of its live rows without the lock a rewrite
// (VACUUM FULL) takes, which every acquire would wait for
// (docs/key-reaping.md#giving-the-space-back).
//
// The other backends return reaped space themselves (memory), reuse it
// (SQLite's freelist; etcd's own compaction and defragmentation) and do
// not implement it.
type Compactor interface {
	// Compact moves the live rows that sit past the space they need
	// toward the table's start, vacuums the table so that its end is
	// truncated, and rebuilds its indexes concurrently. No row changes
	// its content: keys, tokens, holders and deadlines are what they
	// were, and no lease is lost or extended. A row that another
	// transaction has locked (an acquire, renewal or release in flight,
	// a fenced transaction) is skipped, never waited for; a row it
	// locks, it holds for one short transaction per batch, as a reap
	// does. The rebuild waits for transactions older than it (a fenced
	// transaction left open keeps it waiting until ctx ends).
	//
	// It needs the rights of the table's owner (VACUUM and REINDEX); a
	// role without them gets an error before any row is moved.
	Compact(ctx context.Context) (CompactStats, error)
}

// CompactStats is what a [Compactor.Compact] did.
type CompactStats struct {
	// Rows is the number of rows the table held; Moved, how many of them
	// were moved toward its start; Left, how many stayed past the space
	// the rows need (locked by other transactions, or no room found
	// earlier in the table).
	Rows, Moved, Left int64
	// TableBytes and IndexBytes are the table's and its indexes' sizes on
	// disk before and after.
	TableBytes, IndexBytes [2]int64
}
