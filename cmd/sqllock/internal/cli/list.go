package cli

import (
	"context"
	"encoding/json"
	"fmt"
	"text/tabwriter"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

const listUsage = `
Usage: sqllock list [--prefix P] [--json] [flags]

Lists the keys of the lock table (those starting with --prefix), released
and expired ones included: key, whether it is held, the owner of the latest
lease, the latest fencing token, and the time left on the lease by the
database clock.

--json prints an array of objects with the fields
  key, held, owner, token, deadline (RFC 3339, database clock), remaining_ms

Examples:
  sqllock list
  sqllock list --prefix deploy/ --json
`

// lockJSON is one entry of `list --json`; the field names are stable.
type lockJSON struct {
	Key         string    `json:"key"`
	Held        bool      `json:"held"`
	Owner       string    `json:"owner"`
	Token       int64     `json:"token"`
	Deadline    time.Time `json:"deadline"`
	RemainingMS int64     `json:"remaining_ms"`
}

func cmdList(ctx context.Context, e *env, args []string) error {
	var (
		db     dbFlags
		prefix string
		asJSON bool
	)
	fs := e.flagSet("list", listUsage)
	fs.StringVar(&prefix, "prefix", "", "list only keys starting with `prefix`")
	fs.BoolVar(&asJSON, "json", false, "print JSON instead of a table")
	db.register(fs)
	if err := e.parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fail(ExitUsage, "unexpected argument %q (see sqllock list --help)", fs.Arg(0))
	}
	if err := sqllock.ValidatePrefix(prefix); err != nil {
		return fail(ExitUsage, "--prefix: %v", err)
	}
	d, err := e.database(db)
	if err != nil {
		return err
	}
	b, err := e.openBackend(ctx, d, db, 2)
	if err != nil {
		return err
	}
	defer b.close()
	lctx, cancel := d.opContext(ctx)
	infos, err := b.List(lctx, prefix)
	cancel()
	if err != nil {
		return d.opError(err, db)
	}
	if asJSON {
		out := make([]lockJSON, 0, len(infos))
		for _, in := range infos {
			out = append(out, lockJSON{Key: in.Key, Held: in.Held, Owner: in.Owner, Token: in.Token,
				Deadline: in.Deadline.UTC(), RemainingMS: in.Remaining.Milliseconds()})
		}
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(out)
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "KEY\tHELD\tOWNER\tTOKEN\tTIME LEFT")
	for _, in := range infos {
		held, left := "no", "-"
		if in.Held {
			held, left = "yes", in.Remaining.Round(time.Millisecond).String()
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\n", in.Key, held, in.Owner, in.Token, left)
	}
	return tw.Flush()
}
