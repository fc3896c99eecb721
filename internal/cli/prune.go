package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

const pruneUsage = `
Usage: sqllock prune [--older-than D] [flags]

Deletes the rows of keys whose lease ended (released or expired) more than
D ago (default 1h) by the database's clock, in batches of 1000, until none
is left, and prints how many. A held key is never deleted, nor a row that
another transaction has locked (it is skipped, never waited for), nor a
semaphore's rows.

Fencing stays safe: the table keeps a floor above every token of a deleted
key, so a pruned key's next holder gets a larger token than any it had.
SQLite, PostgreSQL and MariaDB prune, after "sqllock migrate up"
(PostgreSQL: migration 00006; MariaDB: 00006).

With --compact (PostgreSQL), it then gives the pruned rows' space back:
VACUUM leaves a table at its size when its live rows sit in its last
pages, as they do after a burst of keys; --compact moves them toward the
start, vacuums and rebuilds the index concurrently, changing no row. It
holds each row it moves for one short transaction (a renewal or release
of that key waits up to 50 ms), never VACUUM FULL's lock
(docs/key-reaping.md). It needs the table owner's rights, and waits for
transactions older than its index rebuild. The other backends reuse or
return that space themselves.

Example:
  sqllock prune --older-than 24h
  sqllock prune --compact
`

// pruneFlags are prune's flags.
type pruneFlags struct {
	db        dbFlags
	olderThan time.Duration
	compact   bool
}

func (f *pruneFlags) register(fs *flag.FlagSet) {
	fs.DurationVar(&f.olderThan, "older-than", time.Hour, "delete keys whose lease ended more than this `duration` ago")
	fs.BoolVar(&f.compact, "compact", false, "then give the space back (PostgreSQL: move live rows, VACUUM, REINDEX CONCURRENTLY)")
}

func cmdPrune(ctx context.Context, e *env, args []string) error {
	var f pruneFlags
	if err := e.parseFlags(e.flagSet("prune", pruneUsage), &f.db, &f, args); err != nil {
		return err
	}
	if err := sqllock.ValidateReap(f.olderThan, sqllock.DefaultReapLimit); err != nil {
		return fail(ExitUsage, "--older-than: %v", err)
	}
	s, err := e.open(ctx, f.db, openOptions{maxConns: 2})
	if err != nil {
		return err
	}
	defer s.close()
	n, err := sqllock.Reap(ctx, s.backend.Backend, f.olderThan)
	switch {
	case errors.Is(err, sqllock.ErrReapUnsupported):
		return fail(ExitFailure, "%s keeps every key: its backend does not prune; nothing was deleted", s.db.display)
	case errors.Is(err, sqllock.ErrSchemaMissing):
		return fail(ExitConfig, "%v", err)
	case err != nil:
		return fail(ExitUnavailable, "pruned %d keys, then: %v", n, err)
	}
	fmt.Fprintf(e.stdout, "pruned %d keys whose lease ended more than %v ago from %s\n", n, f.olderThan, s.db.display)
	if s.db.ext != nil && s.db.ext.PruneNote != "" && n == 0 {
		fmt.Fprintln(e.stdout, s.db.ext.PruneNote)
	}
	if !f.compact {
		return nil
	}
	c, ok := s.backend.Backend.(sqllock.Compactor)
	if !ok {
		fmt.Fprintf(e.stdout, "nothing to compact: %s reuses the space of pruned keys itself\n", s.db.display)
		return nil
	}
	cs, err := c.Compact(ctx)
	switch {
	case errors.Is(err, sqllock.ErrSchemaMissing):
		return fail(ExitConfig, "%v", err)
	case errors.Is(err, sqllock.ErrUnavailable):
		return fail(ExitUnavailable, "compact: %v", err)
	case err != nil:
		// Not the table's owner, or an error the server answered with.
		return fail(ExitConfig, "compact: %v", err)
	}
	fmt.Fprintf(e.stdout, "compacted %s: %d rows, %d moved toward the start, %d left where other transactions held them; table %s -> %s, indexes %s -> %s\n",
		s.db.display, cs.Rows, cs.Moved, cs.Left, mib(cs.TableBytes[0]), mib(cs.TableBytes[1]), mib(cs.IndexBytes[0]), mib(cs.IndexBytes[1]))
	return nil
}

// mib is n bytes in MiB, for prune's report.
func mib(n int64) string { return fmt.Sprintf("%.2f MiB", float64(n)/(1<<20)) }
