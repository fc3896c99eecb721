package mariadb

import (
	"cmp"
	"fmt"
	"strconv"
	"time"

	"github.com/ashlock/ashlock/internal/sqlident"
	"github.com/ashlock/ashlock/migrations"
)

// DefaultLockWait is the zero [Options.LockWait].
const DefaultLockWait = 5 * time.Second

// Options configure a [Backend]. The zero value means the defaults.
type Options struct {
	// Table is the lock table's name in the connection's database, a
	// plain identifier (letters, digits, underscore) of at most 55 bytes,
	// so that the migrations can name its version table
	// "<Table>_version"; empty means migrations.DefaultTable
	// ("sqllock_locks").
	Table string

	// LockWait bounds how long one statement waits for a row lock held by
	// another transaction (an application's fenced transaction, see
	// [Backend.Fence]) before it fails with an error matching
	// [sqllock.ErrUnavailable], applying nothing: InnoDB's
	// innodb_lock_wait_timeout for each statement, in whole seconds
	// (rounded up), from 1s to 1h. Zero means [DefaultLockWait]. Each
	// statement sets it (SET STATEMENT ... FOR), unless [New] finds the
	// session's innodb_lock_wait_timeout equal to it: then none does,
	// which is cheaper for the server. Put it in the DSN
	// (innodb_lock_wait_timeout=5 for the default; the driver sets it on
	// every connection) to have that; a connection the application gives
	// another value with SET SESSION then waits by that value.
	LockWait time.Duration

	// AllowNonDurable lets [New] accept a server whose
	// innodb_flush_log_at_trx_commit is not 1. With 0 or 2 InnoDB writes
	// its log to disk about once a second, so a crash of the server's
	// machine (not of mariadbd alone) can lose the last second of grants
	// after they were reported, and a token can then be handed out twice.
	// Without it, New refuses such a server with [ErrNotDurable]. New reads
	// the setting once: a later SET GLOBAL goes unseen.
	AllowNonDurable bool

	// DisableGroupCommit turns off the client-side group commit: by
	// default, TryAcquire calls that arrive while several of this
	// Backend's acquires are in flight are sent together, as one
	// statement with one commit (see the package doc). Each call's answer
	// is the one it would get alone; an idle Backend sends each call alone
	// at once either way.
	DisableGroupCommit bool
}

// resolve returns o with the defaults filled in, validated.
func (o Options) resolve() (Options, error) {
	o.Table = cmp.Or(o.Table, migrations.DefaultTable)
	if err := sqlident.ValidateTable(o.Table); err != nil {
		return o, fmt.Errorf("sqllock/mariadb: Options.Table: %w", err)
	}
	o.LockWait = cmp.Or(o.LockWait, DefaultLockWait)
	if o.LockWait < 0 || o.LockWait > time.Hour {
		return o, fmt.Errorf("sqllock/mariadb: Options.LockWait %v: want 1s to 1h", o.LockWait)
	}
	return o, nil
}

// lockWaitSeconds is LockWait in whole seconds, rounded up, at least 1.
func (o Options) lockWaitSeconds() string {
	return strconv.FormatInt(int64(max((o.LockWait+time.Second-1)/time.Second, 1)), 10)
}
