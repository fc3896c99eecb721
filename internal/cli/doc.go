// Package cli is the sqllock command: every subcommand, testable with
// injected streams. cmd/sqllock's main only calls [Run].
//
// # Commands
//
//	sqllock migrate up|down|status|sql [--table T] [--schema S] [--force] [--dialect D]
//	sqllock run --key K [--ttl 30s] [--wait 0] [--grace 10s] [--table T] [--log-format json|text] [--log-level L] -- CMD ARGS...
//	sqllock list [--prefix P] [--json] [--watch]
//	sqllock elect --name N [--value V] [--ttl 30s] [--grace 10s] [--log-format json|text] [--log-level L] -- CMD ARGS...
//	sqllock leader --name N [--json]
//	sqllock release --key K --force
//	sqllock bench [--clients N] [--keys N] [--duration D] [--workload uncontended|hot|handoff|all] [--json]
//
// bench works in its own table (sqllock_bench) unless --table names
// another, so its rows never join the real locks.
//
// Every command takes --database-url, --connect-timeout (PostgreSQL and
// MariaDB, default 5s: connecting, run's single attempt without --wait, and each
// statement of list and release; run --wait bounds everything before the
// command starts) and --no-notify (PostgreSQL: waiters poll instead of
// listening, as behind PgBouncer in transaction mode). Without
// --database-url, $SQLLOCK_DATABASE_URL is used,
// else an embedded SQLite file in the user's state directory
// ($XDG_STATE_HOME/sqllock/locks.db, else ~/.local/state/sqllock/locks.db;
// ~/Library/Application Support/sqllock on macOS, %LocalAppData%\sqllock on
// Windows), created on first use with its directory (0700). postgres:// and
// postgresql:// URLs select PostgreSQL (libpq PG* variables fill in what the
// URL leaves out, as pgxpool.ParseConfig does), and so does a keyword/value
// string (host=... dbname=...); mariadb:// and mysql:// URLs
// (mariadb://user:password@host:port/database?params, the query holding
// the driver's DSN parameters, or socket=PATH) select MariaDB, whose
// sessions get READ COMMITTED unless the query sets the isolation;
// sqlite:PATH, or a path with a "/" or a
// .db/.sqlite/.sqlite3 extension and no "=", selects SQLite; anything else
// (another scheme, a bare word) is a configuration error, never guessed. A
// password is never printed, in errors neither: the password field of a URL
// or connection string is shown as xxxxx.
//
// # run
//
// run acquires the key, starts the command in its own process group with
// SQLLOCK_KEY, SQLLOCK_TOKEN and SQLLOCK_OWNER in its environment, lets the
// Guard renew the lease, forwards SIGINT and SIGTERM to the command's group,
// and releases the lease when the command exits. The command runs under a
// supervising process (the sqllock binary re-executed, see supervisor.go)
// that is told every renewed local deadline and stops the command by it,
// whether sqllock exits, is killed, is paused or is cut off from the
// database: SIGTERM --grace before the deadline once renewals are failing
// (or at once when sqllock is gone), SIGKILL at the deadline. A final
// loss (a forced release, a newer token) stops the command at once
// (SIGTERM, SIGKILL after --grace), and run exits [ExitLeaseLost]. When
// stdin is the terminal, the command's group becomes the terminal's
// foreground (so that an interactive command can read it), and a Ctrl-Z
// stop of the command is passed on to sqllock itself, so that the shell
// regains control. docs/cli-supervision.md states the guarantee and its
// limits. Stopping on loss is
// what `consul lock` does, and what
// `etcdctl lock` does not (it leaves the command running after its session
// is lost; etcd's lock_command.go waits on the child only).
//
// With --log-format json or text (or --log-level, which implies text), run
// (and elect) writes log records to stderr instead of plain lines: the lock's history
// from the client's [sqllock.Observer] and Logger (acquired, renewed,
// released, lost, with the attributes key, token, owner, backend, reason)
// and run's own messages (ERROR), so that a cron job's lock history lands
// in a log pipeline.
//
// # Exit statuses
//
// They follow sysexits.h where it has a fitting code:
//
//	0        success; for run, the command's own status
//	1        [ExitFailure]: the operation failed for another reason
//	64       [ExitUsage] (EX_USAGE): bad flag or argument, missing --key,
//	         invalid key, duration or table name, --force missing, run
//	         --ttl below 1s
//	69       [ExitUnavailable] (EX_UNAVAILABLE): the database cannot be
//	         reached, or stayed busy; waiting may heal it (run --wait
//	         keeps trying to connect, with backoff, until the wait ends)
//	75       [ExitTempFail] (EX_TEMPFAIL): run: not acquired (held by another,
//	         or --wait elapsed), or the lease was lost before the command
//	         started, so it was not started; release: a newer holder took the key between
//	         reading and releasing, and was left alone. Retrying may succeed.
//	         run --conflict-exit-code N makes "not acquired" N: a command
//	         that exits 75 itself cannot be told from it otherwise.
//	76       [ExitLeaseLost] (EX_PROTOCOL): run: the lease was lost while the
//	         command ran, and the command was stopped. sysexits.h has no code
//	         for "lost"; 76 ("remote error in protocol") is the closest, the
//	         database having revoked what it granted, and it sits next to 75
//	         so that both lock outcomes are easy to tell from the command's
//	         own small statuses. It wins over the command's own status: the
//	         command's work may have overlapped another holder's.
//	78       [ExitConfig] (EX_CONFIG): unknown URL scheme, unparsable URL,
//	         a password or user the server refused (28P01, 28000), a
//	         database that does not exist (3D000),
//	         the lock table is missing (PostgreSQL: run `sqllock migrate up`),
//	         settings that do not work through a pooler in transaction mode
//	         (PgBouncer: add default_query_exec_mode=exec to the URL and pass
//	         --no-notify), or a SQLite file that waiting cannot make usable:
//	         read-only, not a database, or in a directory that does not exist
//	124      [ExitMaxHold]: run: the command reached --max-hold and was
//	         stopped (SIGTERM --grace before, SIGKILL at it), as timeout(1)
//	         exits 124 for a command it timed out. The lease was still
//	         held until then: no other holder overlapped it.
//	126      [ExitCannotExec]: run: the command could not be started
//	127      [ExitNotFound]: run: the command was not found
//	128+N    run: the command died by signal N (as shells report it), or
//	         sqllock was interrupted by signal N before the command started
package cli
