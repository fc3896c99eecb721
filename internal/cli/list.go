package cli

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"text/tabwriter"
	"time"
	"unicode/utf8"

	"github.com/ashlock/ashlock/sqllock"
)

const listUsage = `
Usage: sqllock list [--prefix P] [--json] [--watch] [flags]

Lists the keys of the lock table (those starting with --prefix), released
and expired ones included: key, whether it is held, the owner of the latest
lease, the latest fencing token, the time left on the lease by the
database clock, and the value the latest holder published with its lease
(an election leader's address, say; "-" for none; shown quoted and cut to
48 characters in the table). A semaphore (run --permits) shows as its key,
HELD "held/permits", OWNER "semaphore" and the time left to the soonest
end of a permit, beside its permits' rows (KEY#permit-I, each a lease).
A key held shared (run --shared) shows HELD "shared", OWNER "(N readers)",
beside its readers' rows (KEY#shared-I, each a lease); a waiting writer's
mark adds "writer-waiting:OWNER".

--json prints an array of objects with the fields
  key, held, owner, token, deadline (RFC 3339, database clock), remaining_ms,
  value (the value as text when it is valid UTF-8, else null) and
  value_base64 (its bytes; both absent when there is none); a semaphore's
  rows also semaphore (its key), and its limit's row permits and
  permits_held; a key held shared also shared (its readers) and
  waiting_writer (a live writer's mark)

--watch lists again every second until interrupted (Ctrl-C, exit 0): to
watch a deploy lock while waiting for it. On a terminal the screen is
cleared before each list; a database error is reported and watching goes
on, except for a missing lock table.

Examples:
  sqllock list
  sqllock list --prefix deploy/ --json
  sqllock list --prefix deploy/ --watch
`

// lockJSON is one entry of `list --json`; the field names are stable.
type lockJSON struct {
	Key         string    `json:"key"`
	Held        bool      `json:"held"`
	Owner       string    `json:"owner"`
	Token       int64     `json:"token"`
	Deadline    time.Time `json:"deadline"`
	RemainingMS int64     `json:"remaining_ms"`
	Value       *string   `json:"value,omitempty"`
	ValueBase64 []byte    `json:"value_base64,omitempty"` // encoding/json writes []byte as base64
	// Semaphore names the semaphore of a permit's or a limit's row;
	// Permits and PermitsHeld are set on the limit's (permits.go).
	Semaphore   string `json:"semaphore,omitempty"`
	Permits     int    `json:"permits,omitempty"`
	PermitsHeld *int   `json:"permits_held,omitempty"`
	// Shared is the number of shared holders of a key held shared (each
	// listed under its KEY#shared-I), WaitingWriter a live writer's mark.
	Shared        int    `json:"shared,omitempty"`
	WaitingWriter string `json:"waiting_writer,omitempty"`
}

// valueText is how the table shows a value: "-" for none, else quoted
// (escaping what a terminal should not print) and cut to maxValueWidth.
func valueText(v []byte) string {
	if len(v) == 0 {
		return "-"
	}
	q := strconv.Quote(string(v))
	if r := []rune(q); len(r) > maxValueWidth {
		q = string(r[:maxValueWidth-1]) + "…"
	}
	return q
}

const maxValueWidth = 48

// jsonValue is a value as list --json and leader --json show it: as text
// when it is valid UTF-8 (else nil), and its bytes; both absent when there
// is none.
func jsonValue(v []byte) (*string, []byte) {
	if len(v) == 0 {
		return nil, nil
	}
	var text *string
	if utf8.Valid(v) {
		s := string(v)
		text = &s
	}
	return text, v
}

// list lists the keys under prefix, the statement bounded as opContext
// says.
func (s *session) list(ctx context.Context, prefix string, db dbFlags) ([]sqllock.LockInfo, error) {
	lctx, cancel := s.db.opContext(ctx)
	defer cancel()
	infos, err := s.backend.List(lctx, prefix)
	if err != nil {
		return nil, s.db.opError(err, db)
	}
	return infos, nil
}

// listFlags are list's flags.
type listFlags struct {
	db            dbFlags
	prefix        string
	asJSON, watch bool
}

func (f *listFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.prefix, "prefix", "", "list only keys starting with `prefix`")
	fs.BoolVar(&f.asJSON, "json", false, "print JSON instead of a table")
	fs.BoolVar(&f.watch, "watch", false, "list again every second until interrupted (Ctrl-C); with --json, one array per line")
}

func cmdList(ctx context.Context, e *env, args []string) error {
	var f listFlags
	if err := e.parseFlags(e.flagSet("list", listUsage), &f.db, &f, args); err != nil {
		return err
	}
	db, prefix, asJSON := f.db, f.prefix, f.asJSON
	if err := sqllock.ValidatePrefix(prefix); err != nil {
		return fail(ExitUsage, "--prefix: %v", err)
	}
	s, err := e.open(ctx, db, openOptions{maxConns: 2, readOnly: true})
	if err != nil {
		return err
	}
	defer s.close()
	if !f.watch {
		return e.listOnce(ctx, s, db, prefix, asJSON, false)
	}
	// --watch: again every second until interrupted. A terminal is
	// cleared before each list; elsewhere the lists follow each other.
	clearScreen := isTerminal(e.stdout) && !asJSON
	tick := time.NewTicker(watchInterval)
	defer tick.Stop()
	for {
		if clearScreen {
			fmt.Fprint(e.stdout, "\033[H\033[2J")
		}
		err := e.listOnce(ctx, s, db, prefix, asJSON, true)
		switch {
		case ctx.Err() != nil:
			return nil // interrupted: the way to end --watch
		case errors.Is(err, sqllock.ErrUnavailable), errors.Is(err, context.DeadlineExceeded):
			// A blip while watching: say so and keep watching.
			e.errorf("sqllock list: %s", stripPrefixes(err.Error()))
		case err != nil:
			return err
		}
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
		}
	}
}

// watchInterval is how often list --watch lists again.
const watchInterval = time.Second

// listOnce prints the list once: a table (under a timestamp line when
// watching), or a JSON array (on one line when watching).
func (e *env) listOnce(ctx context.Context, s *session, db dbFlags, prefix string, asJSON, watching bool) error {
	infos, err := s.list(ctx, prefix, db)
	if err != nil {
		return err
	}
	sems := semaphores(infos)
	if asJSON {
		out := make([]lockJSON, 0, len(infos))
		for _, in := range infos {
			j := lockJSON{Key: in.Key, Held: in.Held, Owner: in.Owner, Token: in.Token,
				Deadline: in.Deadline.UTC(), RemainingMS: in.Remaining.Milliseconds(),
				Shared: in.Shared, WaitingWriter: in.WaitingWriter}
			j.Value, j.ValueBase64 = jsonValue(in.Value)
			semaphoreJSON(&j, in, sems)
			out = append(out, j)
		}
		enc := json.NewEncoder(e.stdout)
		if !watching {
			enc.SetIndent("", "  ")
		}
		return enc.Encode(out)
	}
	if watching {
		fmt.Fprintf(e.stdout, "%s  %s (every %v; Ctrl-C to stop)\n", time.Now().Format(time.TimeOnly), s.db.display, watchInterval)
	}
	tw := tabwriter.NewWriter(e.stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "KEY\tHELD\tOWNER\tTOKEN\tTIME LEFT\tVALUE")
	for _, in := range infos {
		if line, ok := semaphoreLine(in, sems); ok {
			fmt.Fprint(tw, line)
			continue
		}
		held, left, owner := "no", "-", in.Owner
		if in.Held {
			held, left = "yes", in.Remaining.Round(time.Millisecond).String()
		}
		if in.Shared > 0 {
			held, owner = "shared", fmt.Sprintf("(%d readers)", in.Shared)
		}
		if in.WaitingWriter != "" {
			owner += " writer-waiting:" + in.WaitingWriter
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%d\t%s\t%s\n", in.Key, held, owner, in.Token, left, valueText(in.Value))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if watching {
		fmt.Fprintln(e.stdout)
	}
	return nil
}

// isTerminal reports whether w is a terminal.
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	st, err := f.Stat()
	return err == nil && st.Mode()&os.ModeCharDevice != 0
}
