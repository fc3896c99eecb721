package postgres

import (
	"fmt"
	"log/slog"

	"github.com/ashlock/ashlock/internal/sqlident"
)

// DefaultTable is the lock table's name when [Options.Table] is empty.
const DefaultTable = "sqllock_locks"

// Options configure a [Backend]. The zero value is the default.
type Options struct {
	// Schema holds the lock table. Empty means the connection's search_path
	// decides. It must be a plain identifier (ASCII letters, digits and _,
	// not starting with a digit, at most 63 bytes); it is quoted in SQL.
	Schema string

	// Table is the lock table's name, [DefaultTable] when empty. Same rules
	// as Schema, but at most 55 bytes: the migrations name its version table
	// "<Table>_version", and New refuses what could never be migrated.
	Table string

	// DisableNotify turns off LISTEN/NOTIFY: Release sends no notification
	// and [Backend.Watch] returns a channel that never fires, so waiting
	// clients find a released key by polling. Set it behind PgBouncer in
	// transaction mode (or any pooler that does not keep a session; see
	// Poolers in the package doc).
	DisableNotify bool

	// DurableRelease makes Release commit synchronously, like grants and
	// renewals (at least synchronous_commit=on, whatever the session says).
	// By default a release commits asynchronously: it needs no durability
	// (lost in a server crash, the lease just ends at its deadline, as a
	// crashed holder's would; grants and renewals stay durable, and any
	// later grant of the key flushes the release first), and it saves one
	// WAL flush per acquire/release pair. A durable release that notifies a
	// waiter holds PostgreSQL's global NOTIFY lock until its WAL flush, so
	// concurrent notifying releases serialize on the disk; releases that
	// nobody waits for send no notification and do not. Set it where a
	// server crash must not delay the next holder by up to one TTL.
	DurableRelease bool

	// DisableGroupCommit turns off the client-side group commit: by
	// default, TryAcquire and Release calls that arrive while four
	// statements of their kind are already in flight from this Backend
	// wait for one of them to end and then go together, many keys in one
	// statement and one commit (a busy process makes many grants per WAL
	// flush). A call that finds fewer in flight is sent at once, alone,
	// as without it, so an idle process sees no change. Per-key answers
	// are the same either way; see TryAcquire and Release.
	DisableGroupCommit bool

	// UnnamedStatements (NewDB under lib/pq only) sends every statement
	// as lib/pq's unnamed statement, which the server parses and plans on
	// every call, instead of preparing each statement once per connection
	// and then only binding and executing it. The Backend prepares only
	// on connections that reach PostgreSQL itself (its first statement
	// checks: the backend PID the server reports is the one the
	// connection was given at its start), and never behind a pooler; set
	// this where that check can be fooled, such as a pooler that hands
	// out the server's own backend PID while it pools transactions. See
	// docs/postgres-sqldb.md.
	UnnamedStatements bool

	// Logger receives the listener's connection problems, and the warning of
	// a lock table at an older schema version (see Schema versions in the
	// package doc). Nil discards.
	Logger *slog.Logger
}

// quotedTable is the lock table opts name, validated and quoted.
func (opts Options) quotedTable() (string, error) {
	table := opts.Table
	if table == "" {
		table = DefaultTable
	}
	if err := sqlident.ValidateTable(table); err != nil {
		return "", fmt.Errorf("sqllock/postgres: table: %w", err)
	}
	if opts.Schema != "" {
		if err := sqlident.Validate(opts.Schema); err != nil {
			return "", fmt.Errorf("sqllock/postgres: schema: %w", err)
		}
	}
	return sqlident.QuotePostgres(opts.Schema, table), nil
}

// cmpLogger is l, or a logger that discards when l is nil.
func cmpLogger(l *slog.Logger) *slog.Logger {
	if l == nil {
		return slog.New(slog.DiscardHandler)
	}
	return l
}
