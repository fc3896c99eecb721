package postgres

// The statements of the backend. {{table}} is replaced by the validated,
// quoted table name when a Backend is built, and {{table_literal}} by that
// name as a string literal. Keys, owners, tokens and TTLs are
// always bind parameters, never pasted.
//
// Every statement is one round trip and reads the database clock once, and
// it returns the time it used. The single-key statements (acquireSQL,
// renewSQL, releaseSQL) use statement_timestamp(): the server's clock read
// when it began to execute the statement (not now(), the start of the
// enclosing transaction, nor clock_timestamp(), which reads the clock
// again at every call). It is one value wherever the statement uses it,
// and it costs no plan node: a statement that read clock_timestamp() once
// needed a materialized CTE joined into every part, and with PostgreSQL's
// executor setting up every node of a plan on every execution (generic
// plans included), those nodes were most of what the statements cost
// beyond the raw UPDATE (issue 13: executor start-up 76 µs per
// acquire/release pair against 25 for the raw statements, measured with
// perf on this project's benchmark machine). The statement starts after
// its client sent it, so a deadline computed from it is no earlier than
// one computed from the client's send time, the rule the guard's local
// deadline relies on. A release also judges the lease it releases by
// clock_timestamp() in the RETURNING of that row, the instant it released
// it, after any wait for the row's lock (see releaseSQL). The batch
// statements (group commit, batch renewal), one per many leases, read
// clock_timestamp() once in a materialized CTE; they skip the rows that
// other transactions hold locked instead of waiting for them.
// TTLs are bound as whole microseconds, rounded up in Go, and turned into
// an interval with "$n::bigint * interval '1 microsecond'", exact for every
// TTL up to sqllock.MaxTTL.
//
// Grants and renewals are durable whatever the session says: {{durable}}
// (durableSQL), evaluated in the RETURNING of every row a grant or renewal
// writes (in the batch statements' materialized "now" CTE), raises
// synchronous_commit to on for the statement's own transaction when the
// session, role or database has it at off or local; the commit that ends
// the statement reads it.
// An acknowledged grant that a server crash could take back would let the
// next grant repeat its token (G2); a renewal that a crash took back would
// move the database deadline back under the guard's local deadline (G3).
// With synchronous standbys configured, on waits for them too, so a failover
// cannot lose an acknowledged grant either (see below for the exception). remote_write, on and
// remote_apply are kept as the user set them. A refused acquire assigns no
// transaction id and so commits nothing: the setting costs it nothing.
//
// If a statement waits on a row lock (a concurrent writer, or a fenced
// transaction holding the row FOR SHARE), its time is from before the wait:
// an expiry decision made with it is conservative, and a deadline computed
// from it is earlier than it would be, never later. Earlier must not mean
// backwards: a renewal (or a same-owner repeat) that waited may find the
// row already renewed by a later statement of the same lease, whose
// deadline (and the guard's local deadline counted from its send time) is
// later than this one's now + TTL; so these statements keep the later of the
// two (greatest), and a lease's deadline never moves back under its guard.
// A grant of a new tenure sets now + TTL.
//
// With synchronous standbys, an acknowledged grant survives a failover
// unless the wait for the standby was cancelled (pg_cancel_backend, or a
// cancel request sent when a caller's context ended): PostgreSQL then
// commits locally, warns, and answers as for a commit; the Backend reports
// such a statement as of unknown outcome (syncwait.go).

// acquireSQL grants $1 to owner $3 for $2 microseconds, or reports the holder.
//
// It is shaped so that a failed attempt on a held key locks no row, writes no
// WAL and assigns no transaction id (docs/benchmark-targets.md): the grant is a plain
// conditional UPDATE, which does nothing when its WHERE does not match, and
// the INSERT runs only when the UPDATE granted nothing and the key has no
// row at all in the statement's snapshot. An INSERT ... ON CONFLICT DO
// UPDATE ... WHERE on every attempt would lock the row and flush WAL even
// when it grants nothing; here its conflict arm runs only in a race between
// first inserts of a key, which waits for the other insert to end and then
// sees the committed row:
//   - the other insert was this same request (an attempt whose reply was
//     lost while its commit was slow): the conflict arm matches the same
//     owner's unexpired lease and extends it, so the repeat gets the grant
//     back with its token, exactly as the UPDATE's same-owner arm does once
//     the row is in the snapshot;
//   - another owner won: nothing is granted, and the loser reports "held"
//     without details (the row it lost to was not in its snapshot). Like
//     any ON CONFLICT DO UPDATE it has locked the row (so, in this race
//     only, a refused attempt takes a transaction id, and waits if the
//     winner's lease is already in a fenced transaction).
//
// The UPDATE matches in two cases:
//   - a new tenure: the lease is released or expired (deadline <= now), and
//     the token has room to grow (tokens never wrap: at the end of bigint
//     nothing is granted and the caller reports sqllock.ErrTokenExhausted);
//     it clears "waited" (migration 00003): nobody waits for this tenure yet;
//   - a same-owner retry: the lease is held, unexpired, by $3 (an acquire
//     whose reply was lost); the token and "waited" stay and the deadline
//     moves to now + TTL.
//
// The result is always exactly one row: the UPDATE's grant, the INSERT's
// grant, or, when neither granted, the current row as the statement's
// snapshot saw it (token 0 when the key had no row). It is one SELECT over
// left joins of a one-row relation with the two grants and the key's row
// (one index probe, read on a grant too: cheaper than setting up a branch
// that runs only on refusal, since PostgreSQL sets up every node of a plan
// on every execution). Its columns: granted, token, deadline, held, owner
// (the holder's, on refusal), the database time used, "changed" (see the
// waiting form below) and the holder's value (on refusal). Every
// sub-statement sees the same snapshot, so the refusal reports the row as
// it was before the statement.
//
// The waiting form (acquireWaitSQL) is sent while this Backend has a
// watcher of the key (a client's Acquire waits for it, see Backend.Watch):
// {{mark_cte}} adds a third UPDATE that sets "waited" on a lease held,
// unexpired, by another owner that does not have it yet, so that the
// holder's release notifies (releaseSQL). That is one write per waited
// tenure: once it is set, the next attempts match nothing and write
// nothing, like any refused acquire. The mark's row is locked FOR NO KEY
// UPDATE SKIP LOCKED first, so a waiter never waits on a row lock (a fenced
// transaction's FOR SHARE, a renewal or release in flight); and it commits
// asynchronously (set_config in its RETURNING, which only a statement that
// marked evaluates: such a statement granted nothing, so no grant is ever
// made non-durable by it): a lost mark only costs time. The three UPDATEs
// never touch the same row version: their WHEREs exclude each other on the
// snapshot's version, and only a sub-statement that matched it re-checks a
// newer one. {{changed}} is true when the snapshot's row needed the mark but
// the mark did not apply: the row was locked or changed meanwhile (above
// all, the holder released it, and so did not see a mark to notify for),
// and the caller reports a refusal without details, to try again soon. The
// plain form (acquireSQL) has no mark, and "changed" is false.
const acquireSQL = `
WITH upd AS (
    UPDATE {{table}} AS l
    SET token = CASE WHEN l.held AND l.deadline > statement_timestamp() THEN l.token ELSE l.token + 1 END,
        held = true,
        deadline = CASE WHEN l.held AND l.deadline > statement_timestamp()
                        THEN greatest(l.deadline, statement_timestamp() + $2::bigint * interval '1 microsecond')
                        ELSE statement_timestamp() + {{grant_micros}} * interval '1 microsecond' END,
        owner = $3{{set_waited}}{{set_value}}{{set_hold}}
    WHERE l.key = $1
      AND ((l.held AND l.deadline > statement_timestamp() AND l.owner = $3)
           OR (((NOT l.held AND {{hold_passed}}) OR l.deadline <= statement_timestamp()) AND l.token < 9223372036854775807))
    RETURNING l.token, l.deadline, {{durable}} AS durable
), ins AS (
    INSERT INTO {{table}} AS l (key, token, held, deadline, owner{{value_column}}{{hold_column}})
    SELECT $1, 1, true, statement_timestamp() + {{grant_micros}} * interval '1 microsecond', $3{{value_arg}}{{hold_arg}}
    WHERE NOT EXISTS (SELECT FROM upd) AND NOT EXISTS (SELECT FROM {{table}} WHERE key = $1)
    ON CONFLICT (key) DO UPDATE
    SET deadline = greatest(l.deadline, excluded.deadline)
    WHERE l.held AND l.owner = excluded.owner AND l.deadline > statement_timestamp()
    RETURNING l.token, l.deadline, {{durable}} AS durable
){{mark_cte}}
SELECT u.token IS NOT NULL OR i.token IS NOT NULL AS granted,
       coalesce(u.token, i.token, c.token, 0) AS token,
       coalesce(u.deadline, i.deadline, c.deadline, statement_timestamp()) AS deadline,
       coalesce(u.token IS NOT NULL OR i.token IS NOT NULL OR {{taken}}, false) AS held,
       CASE WHEN u.token IS NULL AND i.token IS NULL THEN coalesce(c.owner, '') ELSE '' END AS owner,
       statement_timestamp() AS now,
       u.token IS NULL AND i.token IS NULL AND {{changed}} AS changed,
       CASE WHEN u.token IS NULL AND i.token IS NULL THEN {{holder_value}} END AS value
FROM (SELECT) AS one
LEFT JOIN upd AS u ON true
LEFT JOIN ins AS i ON true
LEFT JOIN {{table}} AS c ON c.key = $1`

// markCTE and changedSQL fill {{mark_cte}} and {{changed}} of acquireSQL in
// its waiting form (acquireWaitSQL); see acquireSQL.
const (
	markCTE = `, mark AS (
    UPDATE {{table}} AS l
    SET waited = true
    WHERE l.key = (
        SELECT w.key FROM {{table}} AS w
        WHERE w.key = $1 AND w.held AND w.deadline > statement_timestamp() AND w.owner <> $3 AND NOT w.waited
        FOR NO KEY UPDATE OF w SKIP LOCKED)
    RETURNING set_config('synchronous_commit', 'off', true) AS async
)`
	changedSQL = `coalesce(c.held AND c.deadline > statement_timestamp() AND c.owner <> $3 AND NOT c.waited
        AND NOT EXISTS (SELECT FROM mark), false)`
)

// setWaitedSQL and waitedSQL fill {{set_waited}} of acquireSQL and
// {{waited}} of releaseSQL on a table with migration 00003's "waited"
// column. On a table without it (a database not yet migrated) the Backend
// falls back to legacySetWaited and legacyWaited: no mark is kept, and
// every release notifies, as before 00003 (see Backend.useLegacy).
const (
	setWaitedSQL = `,
        waited = l.waited AND l.held AND l.deadline > statement_timestamp()`
	waitedSQL       = `l.waited`
	legacySetWaited = ``
	legacyWaited    = `true`
)

// The value of a lease (migration 00004's "value" column, bytea, NULL for
// none) fills acquireSQL's {{set_value}}, {{value_column}}, {{value_arg}}
// and {{holder_value}}, and listSQL's {{list_value}}: every grant sets it
// from $4 (a same-owner repeat sets the same bytes again), a refusal returns
// the holder's, and renewals and releases leave it. A granted row returns
// NULL: the caller has the value it sent. On a table without the column
// (not yet migrated), the Backend uses the forms without it (noValueSQL), as
// it does for "waited", and refuses a request that carries a value with
// sqllock.ErrSchemaMissing (see Backend.withStatements).
const (
	setValueSQL = `,
        value = $4::bytea`
	valueColumnSQL = `, value`
	valueArgSQL    = `, $4::bytea`
	holderValueSQL = `c.value`
	listValueSQL   = `l.value`
	noValueSQL     = `NULL::bytea`
)

// A minimum hold (migration 00005's "hold_until" column, timestamptz,
// NULL for none; sqllock.AcquireRequest.MinHold) fills acquireSQL's
// {{grant_micros}}, {{set_hold}}, {{hold_passed}}, {{hold_column}},
// {{hold_arg}} and {{taken}}, releaseSQL's {{release_hold}} and listSQL's
// {{list_taken}}. acquireSQL's $5 is the min hold in microseconds (rounded
// up, as a TTL; 0 for none). A grant of a new tenure sets the deadline to
// now + the longer of TTL and min hold, and hold_until to now + min hold,
// so a holder that crashes keeps the key until the later of the two; a
// same-owner repeat keeps hold_until. No renewal moves a deadline back
// (greatest() in renewSQL and renewBatchSQL), so none moves it before
// hold_until either, and they need no part of their own. A release by the
// holder itself before hold_until keeps the key taken until then
// (releaseHoldSQL); such a row is released (held false) but "taken": its
// deadline is hold_until, later than now, and no acquire may grant it
// ({{hold_passed}} is false); List shows it held and a refused acquire
// reports it with its owner and token ({{taken}}, {{list_taken}}). The
// waiter's mark and the fenced transaction read held only: a released row
// inside its hold has nothing to notify for and cannot be fenced.
//
// On a table without the column (not yet migrated) the Backend uses the
// forms without it (noHold*), as it does for "value", and refuses a request
// with a min hold with sqllock.ErrSchemaMissing (see Backend.withStatements).
const (
	grantMicrosSQL = `greatest($2::bigint, $5::bigint)`
	setHoldSQL     = `,
        hold_until = CASE WHEN l.held AND l.deadline > statement_timestamp() THEN l.hold_until
                          WHEN $5::bigint > 0 THEN statement_timestamp() + $5::bigint * interval '1 microsecond' END`
	holdPassedSQL = `coalesce(l.hold_until <= statement_timestamp(), true)`
	holdColumnSQL = `, hold_until`
	holdArgSQL    = `,
           CASE WHEN $5::bigint > 0 THEN statement_timestamp() + $5::bigint * interval '1 microsecond' END`
	takenSQL     = `(c.held OR coalesce(c.hold_until > statement_timestamp(), false))`
	listTakenSQL = `(l.held OR coalesce(l.hold_until > n.now, false))`

	noHoldGrantMicros = `$2::bigint`
	noHoldPassed      = `true`
	noHoldTaken       = `c.held`
	noHoldListTaken   = `l.held`
)

// releaseHoldSQL fills releaseSQL's {{release_hold}} on a table with
// "hold_until": a release by the lease's own owner ($3 is the lease's
// owner; the SET expressions read the row as it was) before its
// hold_until, of a lease still valid, sets the deadline to hold_until, so
// the key stays taken until then by the database clock, by the same owner
// and token; after it, or of an expired lease, the deadline stays. A
// release by another owner (a forced release) clears hold_until, so the
// key is free at once. releaseBatchSQL keeps the same rule per lease.
const releaseHoldSQL = `,
        deadline = CASE WHEN l.owner = $3 AND l.hold_until > statement_timestamp() AND l.deadline > statement_timestamp()
                        THEN l.hold_until ELSE l.deadline END,
        hold_until = CASE WHEN l.owner = $3 THEN l.hold_until END`

// renewSQL extends lease ($1, $2) to now + $3 microseconds iff it is held
// and unexpired. It returns one row when the key has a row (none when it
// has not, which the caller reads as token 0): renewed, the new deadline
// (or the current one), the current token and held flag as the snapshot
// saw them, and the database time used. As in acquireSQL, it is one SELECT
// over the key's row and a left join with the UPDATE.
const renewSQL = `
WITH upd AS (
    UPDATE {{table}} AS l
    SET deadline = greatest(l.deadline, statement_timestamp() + $3::bigint * interval '1 microsecond')
    WHERE l.key = $1 AND l.token = $2 AND l.held AND l.deadline > statement_timestamp()
    RETURNING l.deadline, {{durable}} AS durable
)
SELECT u.deadline IS NOT NULL AS renewed, coalesce(u.deadline, c.deadline) AS deadline, c.token, c.held,
       statement_timestamp() AS now
FROM {{table}} AS c LEFT JOIN upd AS u ON true
WHERE c.key = $1`

// renewBatchSQL renews many leases in one statement and one commit: lease
// (key $1[i], token $2[i]) to now + $3[i] microseconds iff it is held and
// unexpired, with every rule of renewSQL: the database clock read once
// (one "now" for the whole batch), {{durable}} raising synchronous_commit
// for the statement's own transaction, greatest() so that no deadline
// moves back, and an UPDATE of the deadline only, which the token-forward
// trigger of migration 00002 lets through. The Go side sends each lease
// (key, token) once, with the longest TTL asked for it.
//
// The rows are locked first, in key order (no deadlock between two
// batches), and a row locked by another transaction is skipped rather than
// waited for (SKIP LOCKED): a fenced transaction holding one lease's row
// FOR SHARE must not stall the renewal of every other lease in the batch.
// The client renews a skipped lease again on its own, with renewSQL, which
// waits for the row.
//
// It returns one row per request row: the key and token, renewed, the new
// deadline (or the current one), the current token (0 when the key has no
// row) and held flag as the snapshot saw them, and the database time used.
// A lease valid in the snapshot but not renewed was skipped (its row was
// locked), or changed after the snapshot: either way the caller asks again
// on its own.
const renewBatchSQL = `
WITH now AS MATERIALIZED (
    SELECT clock_timestamp() AS now,
           {{durable}} AS durable
), req AS MATERIALIZED (
    SELECT r.key, r.token, r.micros
    FROM unnest($1::text[], $2::bigint[], $3::bigint[]) AS r(key, token, micros)
), lk AS MATERIALIZED (
    SELECT l.key, r.token, r.micros
    FROM {{table}} AS l
    JOIN req AS r ON l.key = r.key AND l.token = r.token
    CROSS JOIN now AS n
    WHERE l.held AND l.deadline > n.now
    ORDER BY l.key
    FOR NO KEY UPDATE OF l SKIP LOCKED
), upd AS (
    UPDATE {{table}} AS l
    SET deadline = greatest(l.deadline, n.now + k.micros * interval '1 microsecond')
    FROM lk AS k, now AS n
    WHERE l.key = k.key AND l.token = k.token
    RETURNING l.key, l.token, l.deadline
)
SELECT r.key, r.token, u.key IS NOT NULL AS renewed,
       coalesce(u.deadline, c.deadline, n.now), coalesce(c.token, 0), coalesce(c.held, false), n.now
FROM req AS r
CROSS JOIN now AS n
LEFT JOIN upd AS u ON u.key = r.key AND u.token = r.token
LEFT JOIN {{table}} AS c ON c.key = r.key AND u.key IS NULL`

// releaseSQL clears held on lease ($1, $2) iff its token is current, keeping
// the token and deadline, and records $3 as the owner who released it. It
// returns one row when the key has a row (none when it has not, which the
// caller reads as token 0): released, whether the released lease was still
// valid (its deadline later than the clock read when the row was released,
// after any wait for its row lock: clock_timestamp() in the RETURNING of
// the row it released), the current token, held flag, deadline and owner
// as the snapshot saw them (before the release), the statement's time, and
// how many notifications it sent. As in acquireSQL, it is one SELECT
// over the key's row and a left join with the UPDATE: no branch that is
// set up on every execution to run only when nothing was released.
//
// With a minimum hold ({{release_hold}}, releaseHoldSQL) the holder's own
// release inside it moves the deadline back to hold_until, and "valid"
// reads the new deadline, never later than the old: a release that waited
// on a row lock past hold_until may report as expired a lease whose own
// deadline had not passed, never the reverse.
//
// It commits asynchronously unless Options.DurableRelease is set:
// {{release_commit}} becomes set_config('synchronous_commit', 'off', true),
// which, evaluated in the RETURNING of a row it released, lasts until the
// end of the statement's own transaction (SET LOCAL), so its commit reads
// it; a release that released nothing assigned no transaction id and
// commits nothing. A release needs no durability: if the server crashes
// before the WAL writer flushes it (within a few wal_writer_delay, 200 ms
// by default), the lease comes back as it was and ends at its deadline, as
// a crashed holder's would; tokens are not touched. Any later grant of the
// key commits synchronously and so flushes the release first. This halves
// the fsyncs per acquire/release pair.
//
// With notifications on, {{notify}} sends a pg_notify of the key on the
// table's channel (channelSQL) when (and only when) it released a row that
// a waiter marked ("waited", see acquireSQL), and counts it (pg_notify
// returns void, which is not null); the notification is delivered when the
// statement commits. The key's row is one row (key is the primary key), so
// the output column sends at most one. A release that
// nobody waits for sends nothing: a notifying transaction holds
// PostgreSQL's database-wide notify lock until its commit is flushed, so
// with a durable release every notifying release serializes on the disk
// (bench/README.md: DurableRelease ran 0.16× / 0.14× the raw durable pair
// at 16 / 64 goroutines when every release notified). The mark and the
// release both write the row, so one waits for the other: either the
// release sees the mark (its UPDATE re-reads the row the mark committed),
// or the mark sees the release and does not apply, and the waiter, told the
// row changed, tries again. With notifications off {{notify}} is 0: both
// forms return the same columns.
const releaseSQL = `
WITH upd AS (
    UPDATE {{table}} AS l
    SET held = false, owner = $3{{release_hold}}
    WHERE l.key = $1 AND l.token = $2 AND l.held
    RETURNING l.deadline > clock_timestamp() AS valid, {{waited}} AS waited, {{release_commit}} AS commit
)
SELECT u.valid IS NOT NULL AS released, coalesce(u.valid, false) AS valid,
       c.token, c.held, c.deadline, c.owner, statement_timestamp() AS now, {{notify}} AS notified
FROM {{table}} AS c LEFT JOIN upd AS u ON true
WHERE c.key = $1`

// durableSQL fills {{durable}}: see the top of this file.
const durableSQL = `CASE WHEN current_setting('synchronous_commit') IN ('off', 'local')
                THEN set_config('synchronous_commit', 'on', true) END`

// notifySQL fills {{notify}} of releaseSQL when notifications are on.
const notifySQL = `CASE WHEN u.waited
           THEN num_nonnulls(pg_notify('sqllock.' || {{table_literal}}::regclass::oid::text, $1))
           ELSE 0 END`

// peekSQL reads key $1's row as it is now, outside the snapshot of an
// earlier statement (a Release whose UPDATE lost a race reads it to learn
// who won), with the database time. No row: the key was never granted.
const peekSQL = `
SELECT token, held, deadline, owner, clock_timestamp() FROM {{table}} WHERE key = $1`

// listSQL lists the keys that start with $1 (compared as text, so "%" and
// "_" are literal), in byte order (COLLATE "C", the order of Go strings).
const listSQL = `
SELECT l.key, l.token, l.owner, {{list_taken}} AND l.deadline > n.now AS live, l.deadline, n.now,
       {{list_value}} AS value
FROM {{table}} AS l, (SELECT clock_timestamp() AS now) AS n
WHERE left(l.key, length($1)) = $1
ORDER BY l.key COLLATE "C"`

// fenceSQL starts a fenced transaction: it locks lease ($1, $2) FOR SHARE iff
// it is held and unexpired, so that no acquire can grant the key (its UPDATE
// waits on the share lock) until the transaction ends. It also reports the
// current token, held flag and deadline (snapshot) to explain a miss.
const fenceSQL = `
WITH now AS MATERIALIZED (
    SELECT clock_timestamp() AS now
), locked AS MATERIALIZED (
    SELECT l.deadline FROM {{table}} AS l, now AS n
    WHERE l.key = $1 AND l.token = $2 AND l.held AND l.deadline > n.now
    FOR SHARE OF l
), cur AS MATERIALIZED (
    SELECT token, held, deadline FROM {{table}} WHERE key = $1
)
SELECT k.deadline IS NOT NULL AS locked,
       coalesce(c.token, 0) AS token,
       coalesce(c.held, false) AS held,
       coalesce(c.deadline, n.now) AS deadline,
       n.now
FROM now AS n
LEFT JOIN locked AS k ON true
LEFT JOIN cur AS c ON true`

// channelSQL names the table's notification channel: "sqllock.<table oid>".
// The OID tells apart tables of the same name in different schemas (say one
// per tenant, reached through search_path), so their waiters do not wake
// each other; a channel name from the table name could not.
const channelSQL = `SELECT 'sqllock.' || {{table_literal}}::regclass::oid::text`

// acquireBatchSQL is acquireSQL for many keys in one statement and one
// commit (client-side group commit, see groupcommit.go): key $1[i] to owner
// $3[i] for $2[i] microseconds, with value $4[i]. The Go side sends each
// key once, and only the plain form: an acquire that waits (the waiting
// form, which marks the holder's lease and commits that mark
// asynchronously) is always sent alone, so no asynchronous setting ever
// reaches a transaction that grants (G2), and this statement has none.
//
// Every per-key rule of acquireSQL holds: one "now" for the whole
// statement, read with clock_timestamp(); {{durable}} raises
// synchronous_commit for the statement's own transaction; a new tenure
// takes token + 1 (never past the end of bigint) and clears "waited"; a
// same-owner repeat of a live lease keeps its token and "waited" and
// moves the deadline to greatest(deadline, now + TTL); a key with no row
// is inserted, with acquireSQL's conflict arm for the race between first
// inserts; a key held by another owner is refused with the holder as the
// snapshot saw it, and its row is neither locked nor written: a statement
// whose keys are all refused assigns no transaction id and commits nothing.
//
// The rows to grant are locked first, in key order (two coalescing
// processes never deadlock on each other's rows), and a row locked by
// another transaction is skipped (SKIP LOCKED), never waited for: a fenced
// transaction holding one key's row FOR SHARE, or a release in flight,
// must not stall every other key of the batch. A row grantable in the
// snapshot but not granted was skipped (or changed after the snapshot):
// the row says so ("skipped"), and the client sends that acquire again on
// its own, with acquireSQL, which waits for the row. The INSERT of keys
// that have no row runs in key order too; it waits only in the race
// between first inserts of a key, as acquireSQL does.
//
// The arrays are read through scalar subqueries, unnest((SELECT $1)):
// given the arrays themselves, the planner sizes unnest by each call's
// array and so plans every execution afresh (a custom plan, about 0.5 ms
// of server CPU, more than the execution); through a subquery the size is
// unknown when planning, and the prepared statement keeps one generic
// plan. releaseBatchSQL does the same.
//
// It returns one row per key: the key, granted, token, deadline, held,
// owner (the holder's on refusal), the database time used, skipped and
// the holder's value (on refusal; NULL otherwise). The refusal columns come
// from the snapshot, read only for keys that were not granted.
//
// It is the form with every column (migrations 00003 to 00005; the Backend
// sends it only while it uses those forms), with acquireSQL's min-hold
// rules per key: $5[i] is the min hold in microseconds (0 for none), a new
// tenure's deadline is now + the longer of TTL and min hold and its
// hold_until now + min hold, a same-owner repeat keeps hold_until, a key
// released inside its hold is not free (and is reported held, by its
// owner), and a row is skipped only if it was grantable in the snapshot.
const acquireBatchSQL = `
WITH now AS MATERIALIZED (
    SELECT clock_timestamp() AS now,
           {{durable}} AS durable
), req AS MATERIALIZED (
    SELECT r.key, r.micros, r.owner, r.value, r.hold
    FROM unnest((SELECT $1::text[]), (SELECT $2::bigint[]), (SELECT $3::text[]), (SELECT $4::bytea[]), (SELECT $5::bigint[]))
         AS r(key, micros, owner, value, hold)
), lk AS MATERIALIZED (
    SELECT l.key, r.micros, r.owner, r.value, r.hold
    FROM {{table}} AS l
    JOIN req AS r ON l.key = r.key
    CROSS JOIN now AS n
    WHERE (l.held AND l.deadline > n.now AND l.owner = r.owner)
       OR (((NOT l.held AND coalesce(l.hold_until <= n.now, true)) OR l.deadline <= n.now) AND l.token < 9223372036854775807)
    ORDER BY l.key
    FOR NO KEY UPDATE OF l SKIP LOCKED
), upd AS (
    UPDATE {{table}} AS l
    SET token = CASE WHEN l.held AND l.deadline > n.now THEN l.token ELSE l.token + 1 END,
        held = true,
        deadline = CASE WHEN l.held AND l.deadline > n.now
                        THEN greatest(l.deadline, n.now + k.micros * interval '1 microsecond')
                        ELSE n.now + greatest(k.micros, k.hold) * interval '1 microsecond' END,
        owner = k.owner,
        waited = l.waited AND l.held AND l.deadline > n.now,
        value = k.value,
        hold_until = CASE WHEN l.held AND l.deadline > n.now THEN l.hold_until
                          WHEN k.hold > 0 THEN n.now + k.hold * interval '1 microsecond' END
    FROM lk AS k, now AS n
    WHERE l.key = k.key
      AND ((l.held AND l.deadline > n.now AND l.owner = k.owner)
           OR (((NOT l.held AND coalesce(l.hold_until <= n.now, true)) OR l.deadline <= n.now) AND l.token < 9223372036854775807))
    RETURNING l.key, l.token, l.deadline
), ins AS (
    INSERT INTO {{table}} AS l (key, token, held, deadline, owner, value, hold_until)
    SELECT r.key, 1, true, n.now + greatest(r.micros, r.hold) * interval '1 microsecond', r.owner, r.value,
           CASE WHEN r.hold > 0 THEN n.now + r.hold * interval '1 microsecond' END
    FROM req AS r CROSS JOIN now AS n
    WHERE NOT EXISTS (SELECT FROM {{table}} AS c WHERE c.key = r.key)
    ORDER BY r.key
    ON CONFLICT (key) DO UPDATE
    SET deadline = greatest(l.deadline, excluded.deadline)
    WHERE l.held AND l.owner = excluded.owner AND l.deadline > (SELECT n.now FROM now AS n)
    RETURNING l.key, l.token, l.deadline
)
SELECT r.key,
       u.key IS NOT NULL OR i.key IS NOT NULL AS granted,
       coalesce(u.token, i.token, c.token, 0),
       coalesce(u.deadline, i.deadline, c.deadline, n.now),
       coalesce(c.held OR c.hold_until > n.now, c.held, u.key IS NOT NULL OR i.key IS NOT NULL),
       coalesce(c.owner, ''),
       n.now,
       coalesce((c.held AND c.deadline > n.now AND c.owner = r.owner)
                OR (((NOT c.held AND coalesce(c.hold_until <= n.now, true)) OR c.deadline <= n.now) AND c.token < 9223372036854775807), false) AS skipped,
       c.value
FROM req AS r
CROSS JOIN now AS n
LEFT JOIN upd AS u ON u.key = r.key
LEFT JOIN ins AS i ON i.key = r.key
LEFT JOIN {{table}} AS c ON c.key = r.key AND u.key IS NULL AND i.key IS NULL`

// releaseBatchSQL is releaseSQL for many leases in one statement and one
// commit (client-side group commit, see groupcommit.go): it clears held on
// lease ($1[i], $2[i]) iff its token is current and records $3[i] as the
// owner who released it. The Go side sends each key once. The statement
// reads the clock once, at its start (it never waits on a row lock, so
// that is when it releases), commits as releaseSQL does ({{release_commit}}
// in the RETURNING of each row it released: asynchronously, or durably
// with Options.DurableRelease; one Backend sends only one kind, so a batch
// never mixes them), and notifies (when notifications are on) only for the
// rows it released that a waiter marked.
//
// The rows are locked in key order, SKIP LOCKED, as in acquireBatchSQL: a
// lease whose row is locked (a fenced transaction, a renewal in flight) is
// not released here; its row comes back unreleased with its token current
// and held, and the client releases it again alone with releaseSQL.
//
// It keeps releaseHoldSQL's rule per lease, at the batch's one "now": the
// holder's own release inside its min hold keeps the key taken until
// hold_until, a forced release (another owner) clears it.
//
// It returns one row per lease: the key, released, whether the released
// lease was still valid, the current token, held flag, deadline and owner
// as the snapshot saw them (for leases not released), the database time
// used, and how many notifications it sent.
const releaseBatchSQL = `
WITH now AS MATERIALIZED (
    SELECT clock_timestamp() AS now
), req AS MATERIALIZED (
    SELECT r.key, r.token, r.owner
    FROM unnest((SELECT $1::text[]), (SELECT $2::bigint[]), (SELECT $3::text[])) AS r(key, token, owner)
), lk AS MATERIALIZED (
    SELECT l.key, r.token, r.owner
    FROM {{table}} AS l
    JOIN req AS r ON l.key = r.key AND l.token = r.token
    WHERE l.held
    ORDER BY l.key
    FOR NO KEY UPDATE OF l SKIP LOCKED
), upd AS (
    UPDATE {{table}} AS l
    SET held = false, owner = k.owner,
        deadline = CASE WHEN l.owner = k.owner AND l.hold_until > n.now AND l.deadline > n.now THEN l.hold_until ELSE l.deadline END,
        hold_until = CASE WHEN l.owner = k.owner THEN l.hold_until END
    FROM lk AS k, now AS n
    WHERE l.key = k.key AND l.token = k.token AND l.held
    RETURNING l.key, l.deadline, l.waited AS waited, {{release_commit}} AS commit
)
SELECT r.key, u.key IS NOT NULL AS released, coalesce(u.deadline > n.now, false) AS valid,
       coalesce(c.token, 0), coalesce(c.held, false), coalesce(c.deadline, n.now),
       coalesce(c.owner, ''), n.now, {{notify_batch}} AS notified
FROM req AS r
CROSS JOIN now AS n
LEFT JOIN upd AS u ON u.key = r.key
LEFT JOIN {{table}} AS c ON c.key = r.key AND u.key IS NULL`

// notifyBatchSQL fills {{notify_batch}} of releaseBatchSQL when
// notifications are on: as notifySQL, for each released row a waiter
// marked.
const notifyBatchSQL = `CASE WHEN u.waited
           THEN num_nonnulls(pg_notify('sqllock.' || {{table_literal}}::regclass::oid::text, u.key))
           ELSE 0 END`
