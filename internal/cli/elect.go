package cli

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strconv"
	"syscall"
	"time"

	"github.com/ashlock/ashlock/election"
	"github.com/ashlock/ashlock/internal/wait"
	"github.com/ashlock/ashlock/sqllock"
)

const electUsage = `
Usage: sqllock elect --name NAME [--value V] [--ttl 30s] [--grace 10s] [flags] -- COMMAND [ARGS...]

Runs COMMAND while this process is the leader of the election NAME: one
leader at a time among all the "sqllock elect --name NAME" processes (and
programs using package election) on the same lock table.

  1. Campaigns: waits until no one leads NAME, then takes the term (its
     lock key is "election/NAME").
  2. Starts COMMAND as "sqllock run" does (stdio passed through, its own
     process group, signals forwarded), with these variables added:
       SQLLOCK_ELECTION  NAME
       SQLLOCK_TERM      the term's number, the lease's fencing token:
                         greater than every earlier leader's. Pass it to
                         what the leader writes, and have it refuse a
                         lower one.
       SQLLOCK_KEY, SQLLOCK_TOKEN, SQLLOCK_OWNER  as with "sqllock run"
  3. Renews the term every --ttl/3 while COMMAND runs.
  4. COMMAND is stopped by the term's local deadline, as "sqllock run"
     stops it by its lease's (whatever happens to sqllock); if the term is
     lost (not renewed before it expired, or ended with "sqllock release
     --force"), COMMAND is stopped and sqllock campaigns again; when it
     wins, COMMAND starts again under the new term.
  5. When COMMAND exits by itself, the term is released and sqllock exits
     with COMMAND's status. SIGINT and SIGTERM end a campaign at once, and
     are forwarded to COMMAND while it runs.

--value publishes a value with each term (this instance's address, say):
"sqllock leader" and "sqllock list" show it.

--log-format json (or text) and --log-level write log records to stderr as
with "sqllock run": each term's lease history, and elect's own progress
(leading: INFO; a term ended, a failed campaign: WARN).

Exit status: COMMAND's own (128+N if it died by signal N), except
  64   usage error; 69 database unreachable; 78 configuration error
  (A COMMAND that exits 75 or 76 by itself while its term is held ends
  elect with that status; only a term really lost starts a new campaign.)
  126  COMMAND could not be started; 127 COMMAND not found
  128+N  interrupted by signal N while campaigning; COMMAND was not started

Examples:
  sqllock elect --name billing-scheduler -- ./scheduler
  sqllock elect --name queue-maintainer --value "$(hostname):8080" -- ./maintain
`

const leaderUsage = `
Usage: sqllock leader --name NAME [--json] [flags]

Prints the current term of the election NAME: the leader (its owner name),
the term's number (fencing token), its deadline by the database clock and
the value the leader published; or "no leader", with exit status 75.

--json prints one object with the fields
  name, leading, term, leader, deadline (RFC 3339, database clock),
  value (the value as text when it is valid UTF-8) and value_base64
When no one leads, leading is false and term is the last term (0: never).

Examples:
  sqllock leader --name billing-scheduler
  sqllock leader --name billing-scheduler --json
`

type electFlags struct {
	runFlags
	name  string
	value string
}

func cmdElect(ctx context.Context, e *env, args []string) error {
	var f electFlags
	f.conflictCode = ExitTempFail // a term lost before COMMAND started: campaign again
	fs := e.flagSet("elect", electUsage)
	electionNameVar(fs, &f.name)
	fs.StringVar(&f.value, "value", "", "a `value` published with each term (at most 4096 bytes)")
	durationVar(fs, &f.ttl, "ttl", sqllock.DefaultTTL, "term lease duration, at least 1s; renewed every ttl/3 while COMMAND runs")
	durationVar(fs, &f.grace, "grace", defaultGrace, "after a lost term, time between SIGTERM and SIGKILL")
	err := e.parseCommandLine(fs, args, &f.runFlags, "name", &f.name, func(name string) string { return election.KeyPrefix + name },
		func() error {
			if err := sqllock.ValidateValue([]byte(f.value)); err != nil {
				return fail(ExitUsage, "--value: %v", err)
			}
			return nil
		},
		func() error { return checkCommandTTL(f.ttl, "term") },
		func() error { return nonNegative("grace", f.grace) })
	if err != nil {
		return err
	}

	sigs := make(chan os.Signal, 8)
	e.notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer e.stopNotify(sigs)

	s, err := e.open(ctx, f.db, openOptions{maxConns: 4, client: func(d *database) sqllock.Options {
		return e.clientOptions(f.ttl, d)
	}})
	if err != nil {
		return err
	}
	defer s.close()
	var value []byte
	if f.value != "" {
		value = []byte(f.value)
	}
	el, err := election.New(s.client, election.Config{Name: f.name, TTL: f.ttl, Value: value})
	if err != nil {
		return fail(ExitUsage, "%v", err)
	}
	for lost := 0; ; lost++ {
		l, err := e.campaign(ctx, el, f, s.db, sigs, lost)
		if err != nil {
			return err
		}
		if err := e.lead(ctx, l, f, sigs); err != nil {
			return err
		}
	}
}

// lead runs COMMAND under the term l. It returns nil when the term was
// lost while COMMAND ran (COMMAND was stopped, and elect campaigns again),
// else what ends elect: COMMAND's own status.
func (e *env) lead(ctx context.Context, l *election.Leadership, f electFlags, sigs <-chan os.Signal) error {
	term := l.Term()
	// releaseLost: the release found the term lost (a forced release
	// after the last renewal): lost all the same.
	var releaseLost error
	resign := func(ctx context.Context) error {
		err := l.Resign(ctx)
		if errors.Is(err, sqllock.ErrLeaseLost) {
			releaseLost = err
		}
		return err
	}
	e.notef(slog.LevelInfo, "sqllock elect: leading %q (term %d); starting %s", f.name, term.Token, f.commandRaw)
	t := tenure{
		cmd: "elect", key: f.key, token: term.Token, ctx: l.Context(), release: resign, deadline: l.LocalDeadline,
		env: []string{
			"SQLLOCK_ELECTION=" + f.name,
			"SQLLOCK_TERM=" + strconv.FormatInt(term.Token, 10),
			"SQLLOCK_KEY=" + f.key,
			"SQLLOCK_TOKEN=" + strconv.FormatInt(term.Token, 10),
			"SQLLOCK_OWNER=" + term.Leader,
		},
	}
	err := e.supervise(t, f.runFlags, sigs)
	var s silentExit
	var termLost *sqllock.LostError
	if !errors.As(err, &s) || (int(s) != ExitLeaseLost && int(s) != ExitTempFail) || ctx.Err() != nil ||
		(!errors.As(context.Cause(t.ctx), &termLost) && !errors.As(releaseLost, &termLost)) {
		// COMMAND ended by itself (or could not start): its status,
		// also a 75 or 76 of its own while the term was still held.
		return cmp.Or(err, error(silentExit(ExitOK)))
	}
	e.notef(slog.LevelWarn, "sqllock elect: lost term %d of %q (%s); campaigning again", term.Token, f.name, lossReason(termLost))
	return nil
}

// campaign waits until this process leads, campaigning again after a
// transient error (the database unreachable) with backoff; a signal or the
// end of ctx ends it (not run), an error that waiting cannot mend too.
// lost is how many terms were lost in a row before: a pause of
// DefaultBackoff(lost) comes first, so a leader that keeps losing does not
// hammer the database.
func (e *env) campaign(ctx context.Context, el *election.Election, f electFlags, d *database, sigs <-chan os.Signal, lost int) (*election.Leadership, error) {
	cctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	done := make(chan struct{})
	watched := make(chan struct{})
	var sig os.Signal // read after watched is closed
	go func() {
		defer close(watched)
		select {
		case sig = <-sigs:
			cancel(signalExit{sig})
		case <-ctx.Done():
			sig = signalSoon(sigs)
		case <-done:
		}
	}()
	interrupted := func() error {
		close(done)
		<-watched
		if sig != nil {
			return fail(exitSignalBase+signalNumber(sig), "%v while campaigning for %q; not run", sig, f.name)
		}
		if ctx.Err() != nil {
			return fail(exitSignalBase+2, "interrupted while campaigning for %q (%v); not run", f.name, context.Cause(ctx))
		}
		return nil
	}
	pause := time.Duration(0)
	if lost > 0 {
		pause = sqllock.DefaultBackoff(lost)
	}
	for failures := 0; ; {
		if pause > 0 {
			_ = wait.Sleep(cctx, pause)
		}
		if cctx.Err() != nil {
			return nil, interrupted()
		}
		l, err := el.Campaign(cctx)
		if cctx.Err() != nil {
			if l != nil {
				rctx, cancelRelease := context.WithTimeout(context.Background(), releaseTimeout)
				_ = l.Resign(rctx)
				cancelRelease()
			}
			return nil, interrupted()
		}
		if err == nil {
			if ierr := interrupted(); ierr != nil {
				rctx, cancelRelease := context.WithTimeout(context.Background(), releaseTimeout)
				_ = l.Resign(rctx)
				cancelRelease()
				return nil, ierr
			}
			return l, nil
		}
		if !errors.Is(err, sqllock.ErrUnavailable) && !errors.Is(err, sqllock.ErrIndeterminate) {
			_ = interrupted()
			return nil, d.opError(err, f.db)
		}
		failures++
		pause = sqllock.DefaultBackoff(failures) * 20 // about 0.1s, doubling, up to 5s
		e.notef(slog.LevelWarn, "sqllock elect: campaign for %q: %s; trying again in %v", f.name, stripPrefixes(err.Error()), pause.Round(time.Millisecond))
	}
}

// leaderJSON is the output of `leader --json`; the field names are stable.
type leaderJSON struct {
	Name        string     `json:"name"`
	Leading     bool       `json:"leading"`
	Term        int64      `json:"term"`
	Leader      string     `json:"leader,omitempty"`
	Deadline    *time.Time `json:"deadline,omitempty"`
	Value       *string    `json:"value,omitempty"`
	ValueBase64 []byte     `json:"value_base64,omitempty"`
}

// electionNameVar defines --name, the election's name, of elect and
// leader.
func electionNameVar(fs *flag.FlagSet, p *string) {
	fs.StringVar(p, "name", "", "the election's `name` (required)")
}

// leaderFlags are leader's flags.
type leaderFlags struct {
	db     dbFlags
	name   string
	asJSON bool
}

func (f *leaderFlags) register(fs *flag.FlagSet) {
	electionNameVar(fs, &f.name)
	fs.BoolVar(&f.asJSON, "json", false, "print JSON")
}

func cmdLeader(ctx context.Context, e *env, args []string) error {
	var f leaderFlags
	if err := e.parseFlags(e.flagSet("leader", leaderUsage), &f.db, &f, args); err != nil {
		return err
	}
	if f.name == "" {
		return fail(ExitUsage, "missing --name (see sqllock leader --help)")
	}
	if err := sqllock.ValidateKey(election.KeyPrefix + f.name); err != nil {
		return fail(ExitUsage, "--name: %v", err)
	}
	s, err := e.open(ctx, f.db, openOptions{maxConns: 2, readOnly: true, client: func(*database) sqllock.Options { return sqllock.Options{} }})
	if err != nil {
		return err
	}
	defer s.close()
	el, err := election.New(s.client, election.Config{Name: f.name})
	if err != nil {
		return fail(ExitUsage, "%v", err)
	}
	lctx, cancel := s.db.opContext(ctx)
	term, err := el.Leader(lctx)
	cancel()
	if err != nil && !errors.Is(err, election.ErrNoLeader) {
		return s.db.opError(err, f.db)
	}
	if err := e.printLeader(f.name, term, err, f.asJSON); err != nil {
		return err
	}
	if err != nil {
		return silentExit(ExitTempFail) // no leader
	}
	return nil
}

// printLeader prints the term that Leader returned, or noLeader (an
// ErrNoLeader).
func (e *env) printLeader(name string, term election.Term, noLeader error, asJSON bool) error {
	leading := noLeader == nil
	if asJSON {
		out := leaderJSON{Name: name, Leading: leading}
		if leading {
			out.Term, out.Leader = term.Token, term.Leader
			dl := term.Deadline.UTC()
			out.Deadline = &dl
			out.Value, out.ValueBase64 = jsonValue(term.Value)
		} else {
			out.Term = lastTerm(noLeader)
		}
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(out)
	}
	if leading {
		fmt.Fprintf(e.stdout, "leader of %q: %s, term %d, value %s, deadline %s (database clock)\n",
			name, term.Leader, term.Token, valueText(term.Value), term.Deadline.UTC().Format(time.RFC3339Nano))
	} else {
		fmt.Fprintf(e.stdout, "no leader for %q (last term %d)\n", name, lastTerm(noLeader))
	}
	return nil
}

// lastTerm is the last term an ErrNoLeader error names.
func lastTerm(err error) int64 {
	var nl *election.NoLeaderError
	if errors.As(err, &nl) {
		return nl.LastTerm
	}
	return 0
}
