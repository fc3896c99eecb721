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

Example:
  sqllock prune --older-than 24h
`

// pruneFlags are prune's flags.
type pruneFlags struct {
	db        dbFlags
	olderThan time.Duration
}

func (f *pruneFlags) register(fs *flag.FlagSet) {
	fs.DurationVar(&f.olderThan, "older-than", time.Hour, "delete keys whose lease ended more than this `duration` ago")
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
	return nil
}
