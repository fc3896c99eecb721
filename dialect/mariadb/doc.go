// Package mariadb is ashlock's MariaDB backend: leases and fencing tokens
// in an InnoDB table of the application's MariaDB database (10.6 or later),
// on the application's *sql.DB with github.com/go-sql-driver/mysql. It is a
// Go module of its own, so that users of the other backends never download
// a MySQL driver.
//
// Create the table with package migrations (migrations.MariaDB) or `sqllock
// migrate up`; [New] applies nothing.
//
// # Statements and round trips
//
// TryAcquire is one statement and one round trip, granted or refused: an
// INSERT ... ON DUPLICATE KEY UPDATE ... RETURNING that returns the row as
// the statement left it, so a refusal names the holder. TryRenew and
// Release are one UPDATE each (MariaDB 10.11 has no UPDATE ... RETURNING)
// whose reply reports the database time through LAST_INSERT_ID(expr); when
// the lease was not renewed, or nothing was cleared, one read more tells why
// (losses are rare), and a renewal whose deadline became the end of a min
// hold longer than the TTL reads that deadline. TryRenewBatch renews any
// number of leases in one statement (INSERT ... SELECT ... ON DUPLICATE KEY
// UPDATE ... RETURNING over JSON_TABLE). List is one read. Every statement is
// prepared once per pooled connection, so each later execution is one round
// trip whatever the DSN's interpolateParams. queries.go says why each is
// shaped so.
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
// Every statement runs READ COMMITTED (SET STATEMENT tx_isolation = ...
// FOR), whatever the session's level: REPEATABLE READ would take gap locks
// next to missing keys. Its wait for a row lock is [Options.LockWait]. A
// statement InnoDB rolls back as a deadlock's victim (1213) applied nothing
// and is repeated. A grant is durable when the server commits durably:
// keep innodb_flush_log_at_trx_commit=1 (the default); with 0 or 2 a crash
// of the server's machine can lose the last second of commits, and a token
// reported may be handed out again.
//
// # Tokens never go back
//
// Rows are never deleted (a trigger refuses DELETE and REPLACE) and a
// trigger refuses an UPDATE that lowers a token or renames a key. TRUNCATE
// and DROP fire no triggers: withhold DROP from the application's user.
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
// # Waiters
//
// MariaDB has no LISTEN: [Backend.Watch] wakes waiters of this process on a
// release through the same Backend; other processes poll.
//
// # MySQL
//
// MySQL 8 has no RETURNING at all, so this package refuses it
// ([ErrUnsupportedServer]). One round trip per operation there would need a
// stored procedure per operation (acquire: the same upsert, then a SELECT
// of the row in the procedure, returning one result set; renew and release
// likewise), installed by the migrations and called with CALL; that is not
// shipped, because it is not tested.
package mariadb
