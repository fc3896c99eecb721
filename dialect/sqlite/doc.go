// Package sqlite is ashlock's SQLite backend: leases and fencing tokens in a
// table of a SQLite database file, safe across the processes of one host
// (SQLite's file locks are the arbiter), on modernc.org/sqlite (pure Go, no
// cgo).
//
// [Open] opens a file that the backend owns: it builds the DSN (see [DSN]),
// applies the library's migrations, and closes the database in [Backend.Close].
// [New] wraps an application's own *sql.DB, which it never closes; the
// application then applies the migrations (package migrations, or `sqllock
// migrate up`) and should build its DSN with [DSN] so that every pooled
// connection has the pragmas below.
//
// # Time
//
// SQLite computes every deadline itself, as integer Unix milliseconds from
// the wall clock of the host (all processes on one host share it). TTLs are
// rounded up to whole milliseconds, and one more is added because the clock
// reads whole milliseconds, truncated (see leaseMillis).
//
// The wall clock can step. A step back by d under a holder ends its lease d
// later: a takeover after a crash waits d longer, nothing else changes. A
// step forward by more than the holder's margin ends the lease at the
// database before the holder's local deadline: another process can be
// granted the key while the holder still works, and only the fencing token
// keeps its stale writes out. Keep the clock slewed (NTP), not stepped.
//
// # Statements
//
// TryAcquire and TryRenew are one statement each, also when they fail: a
// refused attempt returns the current row (holder, token, remaining time or
// the reason of the loss) from the same statement and writes nothing.
// Release is one statement unless the lease was already released or
// superseded; then a read follows to tell which. The statements are the
// files of queries/ (why each has its shape: docs/sqlite-statements.md).
//
// # Busy database
//
// SQLite's busy handler is not fair: a process sleeping in it can lose the
// write lock to the same other process again and again. So each connection
// has a short busy_timeout ([Options.BusyTimeout], 10 ms by default) and the
// backend retries SQLITE_BUSY and SQLITE_LOCKED itself, with jittered
// exponential sleeps, for up to [Options.RetryTimeout] or until the caller's
// context ends, whichever is first; then it returns an error matching
// [sqllock.ErrUnavailable]. A raw SQLITE_BUSY never reaches the caller. The
// backend sends at most one write at a time per process (a semaphore), so
// its own goroutines queue in Go instead of fighting in SQLite's busy
// handler: renewals first (a waiting renewal passes waiting acquires and
// releases, at most 8 in a row, so that held leases are not lost behind a
// flood of acquires), otherwise first come first served.
//
// # Outcomes are never indeterminate, except after an I/O error
//
// A statement in flight is never interrupted: the caller's context bounds
// each attempt's wait for a connection (an application's pool may be busy)
// and the sleeps between attempts, but not the statement itself once it has
// its connection (it lasts at most the busy timeout plus one commit). The backend reads the statement to its
// end, so its autocommit transaction has committed when the reply is read.
// Hence an error means the statement did not apply (SQLite rolled it back),
// and a cancelled context yields "not applied" rather than
// [sqllock.ErrIndeterminate]: a statement the context stopped before it
// was sent is the context's error (not [sqllock.ErrUnavailable]: the
// caller gave up, the database did not fail), one stopped while the
// database stayed busy matches [sqllock.ErrUnavailable]. The exception is an I/O error (SQLITE_IOERR,
// for example a failed fsync at commit): the commit record may have reached
// the WAL file and be recovered later, so a write that ends in an I/O error
// is reported as [sqllock.ErrIndeterminate].
//
// # Watcher
//
// SQLite cannot notify other processes, so waiters in other processes poll.
// [Backend.Watch] wakes waiters of this process when a release made through
// the same Backend clears a lease: cheap, and the common case of several
// goroutines of one program waiting for each other.
package sqlite
