// Package mariadb is ashlock's MariaDB backend: leases and fencing tokens
// in an InnoDB table of the application's MariaDB database (10.6 or later;
// CI runs Debian's 10.11), on the application's *sql.DB with
// github.com/go-sql-driver/mysql, which of the module's packages only this
// one and the CLI link: programs on the other backends never build it.
//
// Create the table with package migrations (migrations.MariaDB) or `sqllock
// migrate up`; [New] applies nothing.
//
// # Statements and round trips
//
// Every operation is one statement and one round trip, granted or refused,
// renewed or lost, but for the release of a lease that was no longer held
// and unexpired (two): acquire and renew are an INSERT ... ON DUPLICATE KEY
// UPDATE ... RETURNING that returns the row as the statement left it, so a
// refusal names the holder and a loss its reason. MariaDB 10.11 has no
// UPDATE ... RETURNING, and an UPDATE's reply does not carry
// LAST_INSERT_ID(expr) (it says 0 on 10.11), so renew and the batch
// renewal are INSERT ... SELECT ... WHERE EXISTS (the key's row) ... ON
// DUPLICATE KEY UPDATE ... RETURNING, which never inserts (only the reaper
// deletes rows, and a row it deleted between the SELECT and the insert is
// refused by the floor's check, see below). A release is a plain UPDATE of the held, unexpired lease, its
// affected rows saying whether it cleared it; when it did not, a second
// statement of the renewal's shape clears an expired lease and tells a
// repeat by the owner from a loss. TryRenewBatch renews any number
// of leases in one statement over JSON_TABLE. Each statement is prepared
// once per pooled connection, so each later execution is one round trip
// whatever the DSN's interpolateParams. queries.go says why each is shaped
// so. The statements leave the session's LAST_INSERT_ID() at a value of
// their own: read it only after an insert of yours.
//
// A refused acquire, like any ON DUPLICATE KEY UPDATE, locks the key's row
// for its statement (microseconds); it changes no column.
//
// # Group commit
//
// Concurrent TryAcquire calls of one Backend share one statement and one
// commit: once 4 acquires are in flight, further calls queue, and the
// next acquire to finish sends the queue as one INSERT ... SELECT FROM
// JSON_TABLE ... with the single acquire's ON DUPLICATE KEY UPDATE clause
// and RETURNING (at most 256 keys, each key once, in key order). Release
// calls likewise, with the clause of the release's second statement. Each
// call gets the answer it would get alone, and the same outcome rules: a
// call cancelled while queued was never sent; one whose batch's reply was
// lost is indeterminate. A deadlock repeats the batch; any other error
// from the server sends each member alone. An idle Backend sends each
// call alone at once. [Options.DisableGroupCommit] turns it off.
//
// # Time
//
// The database clock decides: UTC_TIMESTAMP(6), in microseconds, the same
// instant for every use in one statement. Instants are stored as
// DATETIME(6) in UTC (no session time zone converts them) and read back as
// integers, so the driver's parseTime and loc settings change nothing.
//
// # Isolation, deadlocks, durability
//
// Give the handle's sessions READ COMMITTED: the DSN parameter
// tx_isolation='READ-COMMITTED' (mysql.Config.Params), which the driver
// sets on every new connection. SET STATEMENT cannot set the isolation
// level, and a SET per operation would cost a round trip. Each statement is
// one autocommit statement on the primary key, so REPEATABLE READ does not
// make it wrong, but its next-key and gap locks make lock waits and
// deadlocks between neighbouring keys likelier (not measured). A
// statement's wait for a row lock is [Options.LockWait]: SET STATEMENT
// innodb_lock_wait_timeout before each statement, unless [New] finds the
// session's innodb_lock_wait_timeout equal to it already (put
// innodb_lock_wait_timeout=5 in the DSN, for the default), which saves
// the server work at every statement. A statement InnoDB rolls back as a deadlock's
// victim (1213) applied nothing and is repeated. A grant is durable when
// the server commits durably: innodb_flush_log_at_trx_commit=1 (the
// default); with 0 or 2 a crash of the server's machine (not only of
// mariadbd) can lose the last second of commits, and a token reported may
// be handed out again, so [New] refuses such a server ([ErrNotDurable])
// unless [Options.AllowNonDurable].
//
// # Tokens never go back
//
// Rows are deleted only by [Backend.Reap] (a trigger refuses any other
// DELETE and REPLACE, and raises a table-wide floor past each deleted
// token; a key's first row takes the floor + 1 as the Backend last read
// it, and a trigger refuses a first row at or below the newest floor,
// which makes the Backend read it again and resend), and a trigger
// refuses an UPDATE that lowers
// a token or renames a key. The
// token's increment fails at the largest BIGINT whatever the sql_mode
// ([sqllock.ErrTokenExhausted]). TRUNCATE and DROP fire no triggers:
// withhold DROP from the application's user.
//
// # Outcomes
//
// A statement whose reply is lost (the connection breaks, or the caller's
// context ends while it is in flight; the driver then closes the
// connection and the server may still commit) is [sqllock.ErrIndeterminate]
// for acquire and release, and repeating the acquire with the same owner
// returns the same grant. A statement that was never sent is the context's
// error, or [sqllock.ErrUnavailable].
//
// # Fenced transactions
//
// [Backend.FencedTx] runs the application's writes in a transaction that
// holds the lease's row in share mode (LOCK IN SHARE MODE), so no takeover
// is granted until it commits.
//
// # Waiters
//
// MariaDB has no LISTEN: [Backend.Watch] wakes waiters of this process on a
// release through the same Backend; other processes poll.
//
// # MySQL
//
// MySQL 8 has no RETURNING at all, so [New] refuses it
// ([ErrUnsupportedServer]). One round trip per operation there would need a
// stored procedure per operation, installed by the migrations and called
// with CALL: the same upsert, then a SELECT of the row inside the
// procedure, returned as its one result set (acquire, renew and release
// alike; the batch over JSON_TABLE, which MySQL 8 has). Its CALL reply
// would carry the row like RETURNING does. That is on paper only: not
// shipped, because it is not tested.
package mariadb
