package cli

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// A Dialect is a lock service that a build of sqllock links beyond the
// databases this package knows: dialect/etcd's command adds etcd, whose
// client the root module never imports. A database URL whose scheme is
// one of Schemes is the Dialect's; every command but migrate then works
// on the Backend that Open returns, as on any other.
type Dialect struct {
	// Name names the service in messages and logs ("etcd").
	Name string
	// Schemes are the URL schemes it opens, in lower case ("etcd").
	Schemes []string
	// Usage is the form the main help shows, first its URL form and then,
	// after a tab, what it is: "etcd://HOST:PORT[,...][/PREFIX]\tetcd v3".
	Usage string
	// Parse checks raw, a URL of one of Schemes, without any I/O and
	// returns it as messages may show it: without any part of a password.
	// An error is shown (exit 78) after the URL masked by this package, so
	// it must not quote raw either.
	Parse func(raw string) (display string, err error)
	// Open connects to the service raw names and returns the Backend and
	// what closes it. Errors wrapping [sqllock.ErrUnavailable] exit 69
	// (the service cannot be reached); others 78 (refused credentials, a
	// bad certificate); a [*DialectUsageError] 64. Like Parse's, its errors
	// must not quote a password.
	Open func(ctx context.Context, raw string, o DialectOptions) (sqllock.Backend, func(), error)
	// PruneNote, when set, is printed when prune deleted nothing: for a
	// service whose reaping needs saying more (etcd's first reap only
	// starts its clock).
	PruneNote string
}

// DialectOptions are the flags a Dialect's Open gets.
type DialectOptions struct {
	// Table is --table ("" when not given; bench passes its own): for a
	// service without tables, the namespace of the command's locks.
	Table string
	// ConnectTimeout is --connect-timeout, else 5s.
	ConnectTimeout time.Duration
	// Logger is the command's logger (nil: none).
	Logger *slog.Logger
}

// A DialectUsageError is a Dialect's Open error that is the fault of the
// user's flags (exit 64), for example a --table the service cannot take.
type DialectUsageError struct{ Err error }

func (e *DialectUsageError) Error() string { return e.Err.Error() }
func (e *DialectUsageError) Unwrap() error { return e.Err }

// RunWith is [Run] with the Dialects given added to the databases
// --database-url may name.
func RunWith(ctx context.Context, args []string, stdin io.Reader, stdout, stderr io.Writer, dialects ...Dialect) int {
	if cfg := os.Getenv(envSupervisor); cfg != "" {
		return superviseMain(cfg) // started by run or elect: see supervisor.go
	}
	e := &env{
		stdin: stdin, stdout: stdout, stderr: stderr,
		getenv:     os.Getenv,
		environ:    os.Environ,
		notify:     signal.Notify,
		stopNotify: signal.Stop,
		dialects:   dialects,
	}
	return e.run(ctx, args)
}

// dialectOf returns the Dialect that opens scheme, or nil.
func (e *env) dialectOf(scheme string) *Dialect {
	for i := range e.dialects {
		for _, s := range e.dialects[i].Schemes {
			if s == scheme {
				return &e.dialects[i]
			}
		}
	}
	return nil
}

// dialectSchemes lists the Dialects' schemes as the unknown-scheme message
// names them: ", etcd://".
func (e *env) dialectSchemes() string {
	var b strings.Builder
	for _, d := range e.dialects {
		for _, s := range d.Schemes {
			b.WriteString(", " + s + "://")
		}
	}
	return b.String()
}

// parseDialect resolves raw, a URL of d's, without I/O.
func parseDialect(d *Dialect, raw string) (*database, error) {
	display, err := d.Parse(raw)
	if err != nil {
		return nil, fail(ExitConfig, "bad %s URL %s: %s", d.Name, maskConnString(raw), redact(err.Error()))
	}
	return &database{dialect: migrations.Dialect(d.Name), ext: d, raw: raw, display: display}, nil
}

// openDialect opens the Backend of a Dialect's database.
func (e *env) openDialect(ctx context.Context, d *database, f dbFlags) (*backend, error) {
	if f.schema != "" {
		return nil, fail(ExitUsage, "--schema is for PostgreSQL; %s has no schemas", d.ext.Name)
	}
	o := DialectOptions{Table: f.table, ConnectTimeout: d.connectTimeout(), Logger: e.log}
	var (
		b       sqllock.Backend
		closeFn func()
		usage   *DialectUsageError
	)
	err := e.connecting(ctx, func() error {
		var err error
		b, closeFn, err = d.ext.Open(ctx, d.raw, o)
		switch {
		case err == nil:
			return nil
		case errors.As(err, &usage):
			return fail(ExitUsage, "%s", redact(err.Error()))
		case errors.Is(err, sqllock.ErrUnavailable):
			return fail(ExitUnavailable, "cannot reach %s: %s", d.display, redact(err.Error()))
		}
		return fail(ExitConfig, "cannot open %s: %s", d.display, redact(err.Error()))
	})
	if err != nil {
		return nil, err
	}
	return &backend{Backend: b, close: closeFn}, nil
}

// EnvSupervisor is the environment variable that makes a sqllock binary
// run's supervisor (see supervisor.go). A test binary that runs sqllock's
// scripts checks it first in its TestMain, as [RunWith] does, since run
// starts the supervisor as its own executable.
const EnvSupervisor = envSupervisor

// Main is a sqllock binary's main: [RunWith] on the process's arguments
// and standard streams, ended by SIGINT and SIGTERM as Run describes, and
// os.Exit with its status.
func Main(dialects ...Dialect) {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := RunWith(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr, dialects...)
	stop()
	os.Exit(code)
}
