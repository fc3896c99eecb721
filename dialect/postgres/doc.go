// Package postgres is the PostgreSQL [sqllock.Backend], on the application's
// own [*pgxpool.Pool] (github.com/jackc/pgx/v5, [New]) or *sql.DB ([NewDB]:
// pgx's stdlib driver or lib/pq).
//
// The lock table is created by the migrations package (or `sqllock migrate
// up`): one row per key with its latest fencing token, whether it is held,
// its deadline by the database clock and its owner. TryAcquire, TryRenew and
// Release are each one statement and one round trip; the database clock
// (statement_timestamp(), read once per statement) alone decides expiry. A TryAcquire that finds the key
// held locks no row, assigns no transaction id and writes no WAL of its own
// (its read may prune dead row versions that renewals left on the page:
// about one record of ~270 bytes per hundred renewals), so waiters that poll
// a hot key cost the database little. A Release needs no
// durability and commits without waiting for its WAL flush.
//
// Close the Backend (which stops its listener) before closing the pool.
//
// The Backend also implements [sqllock.Watcher] with LISTEN/NOTIFY on one
// shared connection (see [Options.DisableNotify] for PgBouncer in transaction
// mode), and [Backend.FencedTx] runs a transaction in the same database that
// commits only while a lease is held. A release notifies only when a waiter
// marked the lease: while a key is watched, the first refused attempt of a
// tenure sets the row's "waited" column (migration 00003), once; a
// TryAcquire that does not wait never writes.
//
// # On a *sql.DB
//
// [NewDB] serves the same statements, answers and errors on the
// application's *sql.DB, each statement on a *sql.Conn of its own (where
// database/sql never sends it again by itself). Under pgx's stdlib driver
// Watch listens on one connection of the *sql.DB (reached through
// (*sql.Conn).Raw); under lib/pq, or another driver, Watch never fires and
// waiters poll. [Backend.FencedSQLTx] and [Backend.Fence] fence a
// *sql.Tx. Under lib/pq the Backend prepares each statement once per
// connection on a connection that reaches the server itself, and sends
// them unnamed behind a pooler. What differs per driver (a cancelled
// statement, a lost reply, PgBouncer's settings: lib/pq needs
// binary_parameters=yes in transaction mode) is in docs/postgres-sqldb.md.
//
// # Schema versions
//
// The first statement reads the table's schema version (which of the
// migrations' columns it has), in the round trip of the pooler check (see
// Poolers), and the Backend keeps the statements for that version: a
// Backend started before `sqllock migrate up` serves every request that
// needs no missing column (without 00003's "waited" every release
// notifies), refuses one that does (a value, a minimum hold) with
// [sqllock.ErrSchemaMissing] before sending anything, and keeps doing so
// until it is rebuilt after the migration. The statements are in
// queries/*.sql; docs/postgres-statements.md says why each is shaped so,
// and why the older versions are served (rolling upgrades).
//
// # Durability
//
// Grants and renewals commit with synchronous_commit at least on, whatever
// the session, role or database says: where it is off or local, the
// statement raises it to on for its own transaction (and so waits for
// synchronous standbys where the server has them); remote_write, on and
// remote_apply are kept. An acknowledged grant therefore survives a server
// crash, and the next grant's token is greater (G2). This needs the server
// to flush for real: with fsync=off a crash can lose acknowledged grants
// and hand a token out twice, and nothing a client does can prevent it.
// Releases commit asynchronously unless [Options.DurableRelease].
//
// With synchronous standbys, an acknowledged grant or renewal is on a
// standby too, and survives a failover to it. The exception is a commit
// whose wait for the standbys is cancelled (a cancel request when a
// caller's context ends, or an operator's pg_cancel_backend): PostgreSQL
// keeps the local commit, sends a WARNING and answers as for a success. A
// statement that succeeded after its context ended, or with a WARNING, is
// therefore reported as of unknown outcome: [sqllock.ErrIndeterminate] for
// grants (and releases, and FencedTx commits), [sqllock.ErrUnavailable]
// for renewals. pgx hands the WARNING to the pool's ConnConfig.OnNotice
// alone: install [OnNotice] there to have an operator's cancel seen too.
//
// # Isolation levels and failover
//
// Where sessions default to REPEATABLE READ or SERIALIZABLE
// (default_transaction_isolation in the DSN, the role or the database), a
// contended statement may fail with a serialization failure (or, like any
// statement, a deadlock); the server rolled it back, and the backend sends
// it again, a few times with a short jittered pause, before it reports
// [sqllock.ErrUnavailable]. A connection on which the server answers that it
// is read-only (a primary demoted by a failover, or a hot standby) or
// shutting down is closed rather than returned to the pool, so that the next
// operation dials anew and can reach the new primary; the operation that met
// it fails with [sqllock.ErrUnavailable], not applied. Neither costs a round
// trip when it does not happen.
//
// # Poolers
//
// Behind PgBouncer in transaction mode (or any pooler that gives a client
// a server connection for one transaction at a time) two things need a
// session, and so need settings:
//   - pgx's default QueryExecModeCacheStatement prepares named statements
//     on whichever server connection it has; set default_query_exec_mode=exec
//     in the connection string (or cache_describe, or simple_protocol), unless
//     PgBouncer (1.21 or later) has max_prepared_statements > 0;
//   - LISTEN: set [Options.DisableNotify] (waiters then poll).
//
// The backend keeps no other session state: statements are single, each in
// its own transaction, and [Backend.FencedTx] is one transaction. The first
// statement checks whether such a pooler is in between while these settings
// are wrong, and if so every statement fails with [ErrPoolerSettings],
// which says what to set (see ErrPoolerSettings for what the check can and
// cannot see). Session pooling needs nothing: everything works,
// notifications included.
package postgres
