package sqlite

import (
	"cmp"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/ashlock/ashlock/internal/sqlident"
	"github.com/ashlock/ashlock/migrations"
)

// Synchronous is SQLite's synchronous pragma for the database file, which
// decides how durable a grant is.
type Synchronous string

const (
	// SynchronousFull fsyncs the write-ahead log at every commit: a grant
	// that was reported survives a power cut. It costs one fsync per
	// acquire, renew and release (~1-2k acquire+release pairs/s measured).
	SynchronousFull Synchronous = "FULL"

	// SynchronousNormal fsyncs only at checkpoints. In WAL mode this is
	// safe against a crash of the process but not of the machine: a power
	// cut can lose the last commits, so a grant can be lost after it was
	// reported, and the same token can then be handed out twice; a fenced
	// resource would see two holders with one token. It is about 4× faster
	// than FULL (bench/results/latest.md: 4,991 against 1,360 pairs/s on one
	// goroutine; BenchmarkPairs). Choose it only when the lock table dies
	// with the machine anyway (a tmpfs), or when duplicate tokens after a
	// power cut are acceptable.
	SynchronousNormal Synchronous = "NORMAL"
)

// openTimeout bounds the setup I/O of [Open] and [New] (migrations, the
// in-memory check), busy retries included, whatever Options.RetryTimeout.
const openTimeout = 30 * time.Second

// Defaults for the zero [Options].
const (
	DefaultBusyTimeout  = 10 * time.Millisecond
	DefaultRetryTimeout = 2 * time.Second
)

// Options configure a [Backend]. The zero value means the defaults.
type Options struct {
	// Table is the lock table's name, a plain identifier (letters, digits,
	// underscore) of at most 55 bytes, so that the migrations can name its
	// version table "<Table>_version"; empty means migrations.DefaultTable
	// ("sqllock_locks").
	Table string

	// Synchronous is the synchronous pragma for [Open] and [DSN]; empty
	// means [SynchronousFull]. See [SynchronousNormal] for the trade-off.
	// [New] refuses it: set it in your own DSN.
	Synchronous Synchronous

	// BusyTimeout is SQLite's busy_timeout for [Open] and [DSN]: how long
	// one statement waits in SQLite's (unfair) busy handler before the
	// backend's own retry takes over. Zero means [DefaultBusyTimeout];
	// keep it short. [New] refuses it: set it in your own DSN.
	BusyTimeout time.Duration

	// ReadOnly makes [Open] open the file for reading only (SQLite's
	// mode=ro, SQLITE_OPEN_READONLY), for inspection: List and what reads
	// the lock table work on a file this process cannot write, and nothing
	// is migrated (a file without the lock table reports
	// [sqllock.ErrSchemaMissing]); every write fails with an error matching
	// [ErrUnusable]. Without it, Open fails at once, with [ErrUnusable], on
	// a file it cannot write. [DSN] and [New] refuse it: add mode=ro to
	// your own DSN.
	ReadOnly bool

	// RetryTimeout bounds how long one operation retries a busy database
	// (SQLITE_BUSY, SQLITE_LOCKED) before it returns an error matching
	// [sqllock.ErrUnavailable]; the caller's context can end it earlier.
	// Zero means [DefaultRetryTimeout]; negative means no retry.
	RetryTimeout time.Duration
}

// ErrInMemory is returned by [Open], [DSN] and [New] for an in-memory
// database (":memory:", "file::memory:", mode=memory, an empty path). Each
// pooled connection to ":memory:" sees its own empty database, and any
// in-memory database loses its token history when its last connection
// closes, after which tokens restart at 1 and fencing breaks. Use a file, or
// package memory for a lock within one process.
var ErrInMemory = errors.New("sqllock/sqlite: in-memory database refused (use a file, or package memory)")

// resolve returns o with the defaults filled in, validated.
func (o Options) resolve() (Options, error) {
	o.Table = cmp.Or(o.Table, migrations.DefaultTable)
	if err := sqlident.ValidateTable(o.Table); err != nil {
		return o, fmt.Errorf("sqllock/sqlite: Options.Table: %w", err)
	}
	switch strings.ToUpper(string(o.Synchronous)) {
	case "":
		o.Synchronous = SynchronousFull
	case string(SynchronousFull), string(SynchronousNormal):
		o.Synchronous = Synchronous(strings.ToUpper(string(o.Synchronous)))
	default:
		return o, fmt.Errorf("sqllock/sqlite: Options.Synchronous %q: want %q or %q", o.Synchronous, SynchronousFull, SynchronousNormal)
	}
	switch {
	case o.BusyTimeout == 0:
		o.BusyTimeout = DefaultBusyTimeout
	case o.BusyTimeout < time.Millisecond || o.BusyTimeout > time.Minute:
		return o, fmt.Errorf("sqllock/sqlite: Options.BusyTimeout %v: want 1ms to 1m", o.BusyTimeout)
	}
	switch {
	case o.RetryTimeout == 0:
		o.RetryTimeout = DefaultRetryTimeout
	case o.RetryTimeout < 0:
		o.RetryTimeout = 0
	}
	return o, nil
}

// DSN returns the modernc.org/sqlite data source name [Open] uses for the
// database file at path, for applications that open the *sql.DB themselves
// and pass it to [New]. The pragmas are DSN parameters, so that every
// connection of the pool gets them (a db.Exec("PRAGMA ...") reaches one
// connection only):
//
//	_pragma=busy_timeout(N)    Options.BusyTimeout, in ms
//	_pragma=journal_mode(WAL)  readers never block the writer
//	_pragma=synchronous(X)     Options.Synchronous
//	_pragma=foreign_keys(1)    harmless here, expected by applications
//	_txlock=immediate          BEGIN takes the write lock at once, so a
//	                           read-then-write transaction cannot fail with
//	                           SQLITE_BUSY_SNAPSHOT (the backend itself uses
//	                           single statements)
//
// path is a file name, not a URI: a "file:" URI, an empty path and
// ":memory:" are refused (the latter two with [ErrInMemory]), and so is a
// '?' in the path, which the driver would take for the start of the query.
func DSN(path string, opts Options) (string, error) {
	if opts.ReadOnly {
		return "", errors.New("sqllock/sqlite: DSN: Options.ReadOnly is for Open; add mode=ro to a file: URI yourself")
	}
	o, err := opts.resolve()
	if err != nil {
		return "", err
	}
	return dsn(path, o)
}

func dsn(path string, o Options) (string, error) {
	switch {
	case path == "", path == ":memory:",
		strings.HasPrefix(path, "file:") && (strings.Contains(path, ":memory:") || strings.Contains(path, "mode=memory")):
		return "", fmt.Errorf("%w: %q", ErrInMemory, path)
	case strings.HasPrefix(path, "file:"):
		return "", fmt.Errorf("sqllock/sqlite: %q: want a file path, not a URI (or open it yourself and use New)", path)
	case strings.ContainsAny(path, "?\x00"):
		return "", fmt.Errorf("sqllock/sqlite: %q: a path with '?' or NUL is not supported", path)
	}
	ms := (o.BusyTimeout + time.Millisecond - 1) / time.Millisecond
	q := url.Values{}
	q.Add("_pragma", "busy_timeout("+strconv.FormatInt(int64(ms), 10)+")")
	q.Add("_pragma", "journal_mode(WAL)")
	q.Add("_pragma", "synchronous("+string(o.Synchronous)+")")
	q.Add("_pragma", "foreign_keys(1)")
	q.Set("_txlock", "immediate")
	return path + "?" + q.Encode(), nil
}

// readOnlyDSN is the DSN of a read-only Open: a file: URI with mode=ro
// (the driver passes those to SQLite whole), the busy timeout, and no
// journal_mode pragma, which would write.
func readOnlyDSN(path string, o Options) string {
	ms := (o.BusyTimeout + time.Millisecond - 1) / time.Millisecond
	escaped := strings.NewReplacer("%", "%25", "?", "%3f", "#", "%23").Replace(path)
	q := url.Values{}
	q.Set("mode", "ro")
	q.Add("_pragma", "busy_timeout("+strconv.FormatInt(int64(ms), 10)+")")
	return "file:" + escaped + "?" + q.Encode()
}
