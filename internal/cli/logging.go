package cli

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// logFlags are --log-format and --log-level, for the commands that hold a
// lock (run, elect).
type logFlags struct {
	format, level string
}

func (f *logFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.format, "log-format", "", "write log records to stderr, one per line, in `format` json or text: the lock's history (acquired, renewed, released, lost) and sqllock's own messages (default: plain messages only)")
	fs.StringVar(&f.level, "log-level", "", "the least `level` logged: debug (also every acquire attempt and renewal), info, warn or error (default info; it implies --log-format text)")
}

// setup validates the flags and, when logging was asked for, makes e log
// through a slog.Logger on stderr: e.log is then set, and e.errorf writes
// records instead of plain lines.
func (f *logFlags) setup(e *env) error {
	if f.format == "" && f.level == "" {
		return nil
	}
	var level slog.Level
	switch f.level {
	case "debug":
		level = slog.LevelDebug
	case "", "info":
		level = slog.LevelInfo
	case "warn":
		level = slog.LevelWarn
	case "error":
		level = slog.LevelError
	default:
		return fail(ExitUsage, "--log-level %q: must be debug, info, warn or error", f.level)
	}
	opts := &slog.HandlerOptions{Level: level}
	switch f.format {
	case "json":
		e.log = slog.New(slog.NewJSONHandler(e.stderr, opts))
	case "", "text":
		e.log = slog.New(slog.NewTextHandler(e.stderr, opts))
	default:
		return fail(ExitUsage, "--log-format %q: must be json or text", f.format)
	}
	return nil
}

// clientOptions are the Options of the Client of run and elect: their
// lease's ttl, and the logging asked for.
func (e *env) clientOptions(ttl time.Duration, d *database) sqllock.Options {
	opts := sqllock.Options{TTL: ttl, Margin: superviseMargin(ttl), ReleaseTimeout: releaseTimeout, BackendName: string(d.dialect), Logger: e.log}
	if e.log != nil {
		opts.Observer = lockObserver(e.log)
	}
	return opts
}

// notef prints a message that is not an error (elect's progress): a
// record at level when logging, else a plain line as errorf.
func (e *env) notef(level slog.Level, format string, args ...any) {
	if e.log != nil {
		e.log.Log(context.Background(), level, redact(fmt.Sprintf(format, args...)))
		return
	}
	e.errorf(format, args...)
}

// lockObserver logs a lock's history through log: what the client's own
// Logger does not log already (a loss and a transient failure it logs
// itself). Granted acquires and releases are Info; attempts, renewals and
// acquires that did not take the key are Debug. The attribute names are
// the client's: key, token, owner, backend, and outcome, attempts, wait,
// rtt, slack, held.
func lockObserver(log *slog.Logger) *sqllock.Observer {
	return &sqllock.Observer{
		AcquireAttempt: func(ctx context.Context, e sqllock.AcquireAttemptEvent) {
			log.DebugContext(ctx, "sqllock: acquire attempt", "key", e.Key, "owner", e.Owner, "backend", e.Backend,
				"outcome", e.Outcome.String(), "token", e.Token, "rtt", e.Duration)
		},
		Acquire: func(ctx context.Context, e sqllock.AcquireEvent) {
			if e.Outcome == sqllock.OutcomeGranted {
				log.InfoContext(ctx, "sqllock: acquired", "key", e.Key, "token", e.Token, "owner", e.Owner, "backend", e.Backend,
					"attempts", e.Attempts, "wait", e.Duration)
				return
			}
			log.DebugContext(ctx, "sqllock: not acquired", "key", e.Key, "owner", e.Owner, "backend", e.Backend,
				"outcome", e.Outcome.String(), "attempts", e.Attempts, "wait", e.Duration)
		},
		Renew: func(ctx context.Context, e sqllock.RenewEvent) {
			if e.Outcome != sqllock.OutcomeRenewed && e.Outcome != sqllock.OutcomeLate {
				return // a failure: the client logs it (Debug, or Warn for the loss)
			}
			log.DebugContext(ctx, "sqllock: renewed", "key", e.Key, "token", e.Token, "owner", e.Owner, "backend", e.Backend,
				"outcome", e.Outcome.String(), "rtt", e.Duration, "slack", e.Slack)
		},
		Release: func(ctx context.Context, e sqllock.ReleaseEvent) {
			args := []any{"key", e.Key, "token", e.Token, "owner", e.Owner, "backend", e.Backend,
				"outcome", e.Outcome.String(), "held", e.Held}
			if e.Err != nil {
				args = append(args, "err", e.Err)
			}
			log.InfoContext(ctx, "sqllock: released", args...)
		},
	}
}
