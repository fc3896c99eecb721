package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"regexp"
	"runtime"
	"runtime/debug"
	"strconv"
	"strings"
	"time"

	"github.com/ashlock/ashlock/dialect/postgres"
	"github.com/ashlock/ashlock/internal/sqlident"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// Exit statuses. They follow sysexits.h where it has a fitting code; the
// package doc explains each.
const (
	ExitOK          = 0
	ExitFailure     = 1   // an operation failed for a reason not listed below
	ExitUsage       = 64  // EX_USAGE: bad flags or arguments, invalid key or TTL
	ExitUnavailable = 69  // EX_UNAVAILABLE: the database cannot be reached (may heal)
	ExitTempFail    = 75  // EX_TEMPFAIL: not acquired (held by another, or --wait ended)
	ExitLeaseLost   = 76  // EX_PROTOCOL: the lease was lost while the command ran
	ExitConfig      = 78  // EX_CONFIG: bad URL, lock table missing, unusable SQLite file
	ExitMaxHold     = 124 // run: the command was stopped at its --max-hold (as timeout(1) exits)
	ExitCannotExec  = 126 // the command was found but could not be started
	ExitNotFound    = 127 // the command was not found
	exitSignalBase  = 128 // 128+N: died by (or interrupted with) signal N
)

// exitError carries an exit status and a message (one line) to Run.
type exitError struct {
	code int
	err  error
}

func (e *exitError) Error() string { return e.err.Error() }
func (e *exitError) Unwrap() error { return e.err }

// fail returns an error that makes Run print err and exit with code.
func fail(code int, format string, args ...any) error {
	return &exitError{code: code, err: fmt.Errorf(format, args...)}
}

// silentExit makes Run exit with code without printing anything (the
// command's own exit status, or a status whose message was already printed).
type silentExit int

func (s silentExit) Error() string { return fmt.Sprintf("exit status %d", int(s)) }

// env is one invocation's view of the world: the injected streams, the
// environment, and the signal source (os/signal unless a test replaces it).
type env struct {
	stdin          io.Reader
	stdout, stderr io.Writer
	getenv         func(string) string
	environ        func() []string
	notify         func(c chan<- os.Signal, sig ...os.Signal)
	stopNotify     func(c chan<- os.Signal)
	usages         []usageText
	// log, when --log-format or --log-level asked for log records, gets
	// the lock's events and every message errorf would print.
	log *slog.Logger
	// quiet (run --quiet) silences the progress lines of a wait;
	// waitProgress (run --wait) asks for them, and for connecting again
	// until the wait ends.
	quiet, waitProgress bool
	// cmdName is the command running (run, list...), for messages.
	cmdName string
	// dialects are the services beyond the built-in databases (RunWith).
	dialects []Dialect
}

// Run runs the sqllock command line args (without the program name) and
// returns the exit status. It writes results to stdout and diagnostics to
// stderr, one line per error, with any database password redacted. The
// command run by `sqllock run` inherits stdin, stdout and stderr.
//
// ctx ends long waits (an acquire with --wait, bench, migrations); `run`
// handles SIGINT and SIGTERM itself (it forwards them to its command), so
// main's signal.NotifyContext does not stop a running command.
func Run(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer) int {
	return RunWith(ctx, args, stdin, stdout, stderr)
}

type command struct {
	name    string
	summary string
	run     func(ctx context.Context, e *env, args []string) error
}

func commands() []command {
	return []command{
		{"migrate", "create, inspect or drop the lock table (up, down, status, sql)", cmdMigrate},
		{"run", "run a command while holding a lock; stop it if the lock is lost", cmdRun},
		{"elect", "run a command while this process leads an election; campaign again after a loss", cmdElect},
		{"leader", "print the current leader of an election (exit 75: no leader)", cmdLeader},
		{"list", "list locks: key, held, owner, fencing token, time left, value", cmdList},
		{"release", "end a lease by key, whoever holds it (needs --force)", cmdRelease},
		{"prune", "delete keys whose lease ended long ago (tokens never go back)", cmdPrune},
		{"bench", "load-test the lock table of a database (like pgbench, for locks)", cmdBench},
	}
}

const mainUsage = `sqllock: distributed locks (leases with fencing tokens) in a SQL database.

Usage:
  sqllock <command> [flags] [arguments]

Commands:
%s
The database comes from --database-url, else $SQLLOCK_DATABASE_URL, else an
embedded SQLite file in your state directory (%s),
created on first use:
  postgres://... or postgresql://...   PostgreSQL (libpq PG* variables fill
                                       in what the URL leaves out)
  host=... dbname=... user=...         PostgreSQL, keyword/value form
  mariadb://user:pw@host/db            MariaDB 10.6+ (or mysql://; the query
                                       holds the driver's DSN parameters)
  sqlite:PATH                          SQLite (created and migrated on use)
  a path with a "/" or ending in .db,  SQLite too; never a string with "=":
  .sqlite or .sqlite3                  write sqlite:PATH for any other name
%sAnything else (a bare word such as "locks") is refused with exit 78.
--connect-timeout (default 5s) bounds connecting to PostgreSQL or MariaDB.

Exit statuses (all commands):
  0    success (run: the command's own status)
  1    the operation failed for another reason
  64   usage error: bad flag, missing --key, invalid key or duration
       (run: --ttl below 1s)
  69   the database cannot be reached (waiting may heal it; run --wait
       keeps trying until the wait ends)
  75   run: not acquired (held by another; --wait elapsed), or the lease
       was lost before the command started; it was not started
       (run --conflict-exit-code N: N instead)
       leader: no one leads the election
       release: a newer holder appeared in between; nothing released
  76   run: the lease was lost while the command ran; it was stopped
  78   configuration error: unknown URL scheme, bad URL, password or
       user refused, database missing, lock table missing, SQLite file
       read-only, not a database or in a missing directory
  124  run: the command reached --max-hold and was stopped
  126  run, elect: the command could not be started
  127  run, elect: the command was not found
  128+N  run, elect: the command died by signal N, or sqllock was
       interrupted by it

Run "sqllock <command> --help" for a command's flags and an example.

Example:
  sqllock run --key nightly-report -- ./report.sh
`

func (e *env) mainUsage(w io.Writer) {
	var b strings.Builder
	for _, c := range commands() {
		fmt.Fprintf(&b, "  %-8s %s\n", c.name, c.summary)
	}
	var ext strings.Builder
	for _, d := range e.dialects {
		form, what, _ := strings.Cut(d.Usage, "\t")
		fmt.Fprintf(&ext, "  %-36s %s\n", form, what)
	}
	fmt.Fprintf(w, mainUsage, b.String(), defaultPathForHelp(e.getenv), ext.String())
}

func (e *env) run(ctx context.Context, args []string) int {
	if len(args) == 0 {
		e.mainUsage(e.stderr)
		return ExitUsage
	}
	name := args[0]
	switch name {
	case "-version", "--version", "version":
		fmt.Fprintln(e.stdout, versionLine())
		return ExitOK
	case "-h", "-help", "--help", "help":
		if name == "help" && len(args) > 1 {
			return e.run(ctx, []string{args[1], "--help"})
		}
		e.mainUsage(e.stdout)
		return ExitOK
	}
	for _, c := range commands() {
		if c.name == name {
			e.cmdName = name
			return e.finish(name, c.run(ctx, e, args[1:]))
		}
	}
	names := make([]string, 0, len(commands()))
	for _, c := range commands() {
		names = append(names, c.name)
	}
	e.errorf("sqllock: unknown command %q (commands: %s; see sqllock --help)", name, strings.Join(names, ", "))
	return ExitUsage
}

// finish prints err (one line, redacted) and returns its exit status.
func (e *env) finish(name string, err error) int {
	if err == nil {
		return ExitOK
	}
	if errors.Is(err, flag.ErrHelp) {
		return ExitOK
	}
	var s silentExit
	if errors.As(err, &s) {
		return int(s)
	}
	msg := stripPrefixes(err.Error())
	if errors.Is(err, postgres.ErrPoolerSettings) {
		msg += " (for sqllock: default_query_exec_mode=exec in the database URL, and --no-notify)"
	}
	e.errorf("sqllock %s: %s", name, msg)
	return exitCode(err)
}

// errorf prints one line to stderr, with the password fields of URLs and
// connection strings redacted and line breaks folded into "; ".
func (e *env) errorf(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	lines := strings.FieldsFunc(msg, func(r rune) bool { return r == '\n' || r == '\r' })
	for i, l := range lines {
		lines[i] = strings.TrimSpace(l)
	}
	msg = strings.Join(lines, "; ") // errors.Join and multi-line driver errors
	if e.log != nil {
		e.log.Error(redact(msg))
		return
	}
	fmt.Fprintln(e.stderr, redact(msg))
}

// exitCode maps an error to the exit status that describes it.
func exitCode(err error) int {
	var xe *exitError
	if errors.As(err, &xe) {
		return xe.code
	}
	switch {
	case errors.Is(err, sqllock.ErrInvalidKey), errors.Is(err, sqllock.ErrInvalidTTL),
		errors.Is(err, sqllock.ErrInvalidOwner), errors.Is(err, migrations.ErrInvalidIdentifier):
		return ExitUsage
	case errors.Is(err, sqllock.ErrNotAcquired):
		return ExitTempFail
	case errors.Is(err, sqllock.ErrLeaseLost):
		return ExitLeaseLost
	case errors.Is(err, sqllock.ErrSchemaMissing), errors.Is(err, postgres.ErrPoolerSettings):
		return ExitConfig
	case errors.Is(err, sqllock.ErrUnavailable), errors.Is(err, sqllock.ErrIndeterminate),
		errors.Is(err, context.DeadlineExceeded):
		return ExitUnavailable
	case errors.Is(err, context.Canceled):
		return exitSignalBase + 2 // interrupted (SIGINT)
	}
	return ExitFailure
}

// versionLine is what --version prints: the module version sqllock was
// built from ("go install ...@v0.1.0" records it; a build in a clone says
// "(devel)" and its commit), and the Go version.
func versionLine() string {
	v, rev := "(devel)", ""
	dirty := false
	if bi, ok := debug.ReadBuildInfo(); ok {
		if bi.Main.Version != "" {
			v = bi.Main.Version
		}
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				dirty = s.Value == "true"
			}
		}
	}
	line := "sqllock " + v
	if rev != "" && !strings.Contains(v, rev[:min(12, len(rev))]) {
		line += " (commit " + rev[:min(12, len(rev))]
		if dirty {
			line += ", modified"
		}
		line += ")"
	}
	return line + " " + runtime.Version()
}

// flagSet returns a FlagSet for one subcommand with the usage text given.
// It prints nothing itself: parse errors become one line, and --help prints
// the usage to stdout.
func (e *env) flagSet(name, usage string) *flag.FlagSet {
	fs := flag.NewFlagSet("sqllock "+name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	// flag calls Usage on every parse error too; parse prints the usage
	// for --help only.
	fs.Usage = func() {}
	e.usages = append(e.usages, usageText{fs, usage})
	return fs
}

type usageText struct {
	fs   *flag.FlagSet
	text string
}

func (e *env) printUsage(fs *flag.FlagSet) {
	for _, u := range e.usages {
		if u.fs == fs {
			fmt.Fprint(e.stdout, strings.TrimLeft(u.text, "\n"))
		}
	}
	fmt.Fprintln(e.stdout, "\nFlags:")
	printFlags(e.stdout, fs)
}

// hiddenBool is a bool flag that printFlags does not list: accepted where
// it does nothing.
type hiddenBool struct{ p *bool }

func (h hiddenBool) String() string {
	if h.p == nil {
		return "false"
	}
	return strconv.FormatBool(*h.p)
}

func (h hiddenBool) Set(s string) error {
	v, err := strconv.ParseBool(s)
	if err != nil {
		return errors.New(flagBadBoolMsg)
	}
	*h.p = v
	return nil
}

func (hiddenBool) IsBoolFlag() bool { return true }

// printFlags lists fs's flags as the README writes them: --name, its
// argument, then the usage and any default on an indented line. Hidden
// flags are left out.
func printFlags(w io.Writer, fs *flag.FlagSet) {
	fs.VisitAll(func(f *flag.Flag) {
		if _, ok := f.Value.(hiddenBool); ok {
			return
		}
		arg, usage := flag.UnquoteUsage(f)
		if _, ok := f.Value.(*durationValue); ok && arg == "value" {
			arg = "duration"
		}
		line := "  --" + f.Name
		if arg != "" {
			line += " " + arg
		}
		switch f.DefValue {
		case "", "0", "0s", "false":
		default:
			usage += fmt.Sprintf(" (default %s)", f.DefValue)
		}
		fmt.Fprintf(w, "%s\n    \t%s\n", line, strings.ReplaceAll(usage, "\n", "\n    \t"))
	})
}

// flagErrRE and friends match the flag package's parse errors, which name
// flags with one dash; sqllock writes two, as its help and README do.
var (
	flagInvalidRE  = regexp.MustCompile(`^invalid value "(.*)" for flag -([\w-]+): (.*)$`)
	flagUnknownRE  = regexp.MustCompile(`^flag provided but not defined: -+([\w-]+)$`)
	flagNoValueRE  = regexp.MustCompile(`^flag needs an argument: -+([\w-]+)$`)
	flagBadBoolMsg = "parse error"
)

// flagError rewrites a parse error of the flag package. args are the
// arguments parsed: an unknown flag is named as it was typed (-n stays -n),
// since the flag package strips its dashes.
func flagError(err error, args []string) string {
	msg := err.Error()
	if m := flagInvalidRE.FindStringSubmatch(msg); m != nil {
		why := m[3]
		if why == flagBadBoolMsg {
			why = "not a valid value"
		}
		return fmt.Sprintf("--%s %q: %s", m[2], m[1], why)
	}
	if m := flagUnknownRE.FindStringSubmatch(msg); m != nil {
		for _, a := range args {
			if a == "--" {
				break
			}
			if name, _, _ := strings.Cut(a, "="); strings.TrimLeft(name, "-") == m[1] && strings.HasPrefix(name, "-") {
				return "unknown flag " + name
			}
		}
		return "unknown flag --" + m[1]
	}
	if m := flagNoValueRE.FindStringSubmatch(msg); m != nil {
		return "--" + m[1] + " needs a value"
	}
	return msg
}

// parse parses args; a parse error becomes a usage error naming --help.
func (e *env) parse(fs *flag.FlagSet, args []string) error {
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			e.printUsage(fs)
			return err
		}
		return fail(ExitUsage, "%s (see %s --help)", flagError(err, args), fs.Name())
	}
	return nil
}

// durationValue is a duration flag whose errors say what is wrong: a bare
// number is a missing unit, not a "parse error".
type durationValue time.Duration

func durationVar(fs *flag.FlagSet, p *time.Duration, name string, value time.Duration, usage string) {
	*p = value
	fs.Var((*durationValue)(p), name, usage)
}

func (d *durationValue) Set(s string) error {
	v, err := time.ParseDuration(s)
	if err != nil {
		if _, nerr := strconv.ParseFloat(s, 64); nerr == nil {
			return fmt.Errorf("missing unit, e.g. %ss", s)
		}
		return errors.New("not a duration, e.g. 30s, 5m or 1h30m")
	}
	*d = durationValue(v)
	return nil
}

func (d *durationValue) String() string { return fmtDuration(time.Duration(*d)) }

// fmtDuration writes d as people do: 24h, 1h30m, 10m, 1s, 1ms (Go's
// String writes 24h0m0s).
func fmtDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// checkTTL checks a --ttl against [lo, hi], in words.
func checkTTL(ttl, lo, hi time.Duration) error {
	if ttl < lo || ttl > hi {
		return fail(ExitUsage, "--ttl %s: must be from %s to %s", fmtDuration(ttl), fmtDuration(lo), fmtDuration(hi))
	}
	return nil
}

// prefixRE matches the package prefixes that wrapped errors stack up
// ("sqllock/postgres: acquire: sqllock: ..."); a message prints its
// command's name once and the rest without them.
var prefixRE = regexp.MustCompile(`(^|: )(?:sqllock/postgres|sqllock/sqlite|sqllock|sqlite|migrations|sqlident): `)

func stripPrefixes(msg string) string {
	for {
		out := prefixRE.ReplaceAllString(msg, "$1")
		if out == msg {
			return out
		}
		msg = out
	}
}

// dbFlags are the flags every database command has.
type dbFlags struct {
	url, table, schema string
	connectTimeout     time.Duration
	noNotify           bool
}

func (f *dbFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.url, "database-url", "", "`URL` of the database (default $SQLLOCK_DATABASE_URL, else the embedded SQLite file)")
	tableUsage := "lock `table` name (default sqllock_locks)"
	if fs.Name() == "sqllock bench" {
		tableUsage = "lock `table` to bench in (default " + benchTable + ": its own, never the table of your real locks unless named here)"
	}
	fs.StringVar(&f.table, "table", "", tableUsage)
	fs.StringVar(&f.schema, "schema", "", "PostgreSQL `schema` of the lock table (default: the search_path)")
	// Each command's help says what --connect-timeout bounds for it, and
	// only the commands that wait for a release have --no-notify.
	bounds := ""
	switch fs.Name() {
	case "sqllock run":
		bounds = "; it also bounds the single acquire attempt (without --wait)"
	case "sqllock list", "sqllock release", "sqllock leader":
		bounds = "; it also bounds each statement"
	}
	switch fs.Name() {
	case "sqllock run", "sqllock elect", "sqllock bench":
		fs.BoolVar(&f.noNotify, "no-notify", false, "PostgreSQL: do not LISTEN for releases (waiters poll); needed behind PgBouncer in transaction mode")
	default:
		// Accepted (a script may pass the same flags to every command),
		// but not shown: nothing else waits for a release.
		fs.Var(hiddenBool{&f.noNotify}, "no-notify", "")
	}
	durationVar(fs, &f.connectTimeout, "connect-timeout", 0, "PostgreSQL, MariaDB: how long connecting may take"+bounds+" (default: the URL's connect_timeout, else $PGCONNECT_TIMEOUT, else 5s; MariaDB: the URL's timeout, else 5s)")
}

// flagger is a command's own flags.
type flagger interface{ register(fs *flag.FlagSet) }

// parseFlags registers a command's own flags and the database's on fs and
// parses args, which hold flags only: the commands that take no
// arguments.
func (e *env) parseFlags(fs *flag.FlagSet, db *dbFlags, own flagger, args []string) error {
	own.register(fs)
	db.register(fs)
	if err := e.parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fail(ExitUsage, "unexpected argument %q (see %s --help)", fs.Arg(0), fs.Name())
	}
	return nil
}

// validate checks --table and --schema before any I/O, by the rules the
// backends and the migrations share.
func (f *dbFlags) validate() error {
	if f.connectTimeout < 0 {
		return fail(ExitUsage, "--connect-timeout %v: must not be negative", f.connectTimeout)
	}
	if f.table != "" {
		if err := sqlident.ValidateTable(f.table); err != nil {
			return fail(ExitUsage, "--table: %v", err)
		}
	}
	if f.schema != "" {
		if err := sqlident.Validate(f.schema); err != nil {
			return fail(ExitUsage, "--schema: %v", err)
		}
	}
	return nil
}

// positiveDuration refuses negative durations with a usage error.
func nonNegative(name string, d time.Duration) error {
	if d < 0 {
		return fail(ExitUsage, "--%s %v: must not be negative", name, d)
	}
	return nil
}

// noFlags is a command without flags of its own besides those it
// registers itself.
type noFlags struct{}

func (noFlags) register(*flag.FlagSet) {}
