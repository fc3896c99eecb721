package mariadb

import (
	"strconv"
	"strings"

	"github.com/ashlock/ashlock/internal/sqlident"
)

// floorSuffix names the table's token floor (migration 00004): the lock
// table's name + "_floor", as package migrations makes it.
const floorSuffix = "_floor"

// The statements, with {{table}} for the quoted table, {{floor}} for its
// token floor (migration 00004), {{now}} for the database clock, {{us
// ...}} for an instant in Unix microseconds, {{free}} for freeSQL,
// {{first}} for firstSQL and {{reapable}} for reapableSQL. Each runs in autocommit mode, under stmtPrefix
// unless the session's lock wait is Options.LockWait already.
//
// The clock is UTC_TIMESTAMP(6): the server's clock in UTC with
// microseconds, the same instant for every use in one statement (SET,
// WHERE and RETURNING see one value; SYSDATE(6) would not). Instants are
// stored as DATETIME(6), which no session time zone converts, and leave
// the server as integers of Unix microseconds, so that no driver setting
// (parseTime, loc) can change them.
//
// MariaDB 10.11 has INSERT ... RETURNING but not UPDATE ... RETURNING
// (13.0 has it), and MySQL has neither; see the package doc. So every
// write is an INSERT ... ON DUPLICATE KEY UPDATE ... RETURNING.
const (
	// stmtPrefix bounds every statement's wait for a row lock (held by an
	// application's fenced transaction, say) to Options.LockWait instead of
	// the server's 50 s. Isolation cannot be set so (SET STATEMENT refuses
	// tx_isolation): it is the session's, READ COMMITTED by the DSN (see
	// the package doc).
	stmtPrefix = `SET STATEMENT innodb_lock_wait_timeout = {{lockwait}} FOR `

	// acquireSQL: ?1 key, ?2 a first token (see below), ?3 lease in µs
	// (the longer of TTL and MinHold), ?4 owner, ?5 value (NULL for none),
	// ?6 and ?7 the min hold in µs (0 for none). One INSERT ... ON
	// DUPLICATE KEY UPDATE ... RETURNING: a key without a row is inserted
	// with token ?2; an existing one is updated in place, and RETURNING
	// gives the row as it is after the statement, granted or not, so a
	// refusal names the holder from the same round trip. An existing key's
	// token goes on from its own (token + 1).
	//
	// ?2 is the floor of reaped keys + 1 as this Backend last read it
	// (Backend.floor; firstToken), not firstSQL: a subquery on the floor
	// table in every acquire, which nearly always takes the update path
	// and never uses it, cost about a fifth of the server's CPU per
	// acquire and release pair (bench/, docs/mariadb.md). Migration
	// 00005's check, not this value, keeps a first token above the floor:
	// it reads the newest committed floor with a lock after the row is in,
	// and refuses a first row at or below it (SQLSTATE 40001), which the
	// Backend answers by reading the floor again and resending
	// (tryAcquire): a floor raised since this Backend read it costs one
	// refused statement and one read, once per raise. A cached floor is
	// never above the table's (floors only rise), so ?2 never skips more
	// tokens than firstSQL would.
	//
	// The trap: MariaDB runs the ON DUPLICATE KEY UPDATE assignments left
	// to right, and each one sees the columns assigned before it with their
	// new values. So the decision is taken once, by the first assignment,
	// on the row as it was, into the session's LAST_INSERT_ID(expr): bit 1
	// a new tenure (the key is free: expired, or released and past its min
	// hold), bit 2 a grant (a new tenure, or the same owner's repeat while
	// its grant lasts: same token, deadline extended), as IF(free, 3,
	// 2 * repeat), which names freeSQL once (the server resolves every
	// expression of a prepared statement again at each execution); every
	// later assignment reads LAST_INSERT_ID() and only columns not yet
	// assigned.
	// A new tenure takes its own min hold (hold_until from its own grant),
	// whoever held the key before, the same owner too (its acquire repeated
	// after its own lease expired); the same owner's repeat inside its grant
	// keeps the tenure's hold_until and never moves its deadline before it.
	// (Session variables would do the same on paper, but a RETURNING that
	// reads one the session never set reads NULL: LAST_INSERT_ID() has a
	// value in every session, and the insert path reads none.) The
	// session's LAST_INSERT_ID() is left at that value: an application
	// reading LAST_INSERT_ID() on a pooled connection without its own
	// insert before sees it.
	//
	// token + 1 at the largest BIGINT fails the statement with error 1690
	// (out of range) and applies nothing: the token space ends closed
	// (sqllock.ErrTokenExhausted), never wraps. The addition is signed
	// (IF(..., 1, 0), not the unsigned LAST_INSERT_ID() & 1) so that it
	// fails whatever the session's sql_mode: an unsigned sum would only be
	// stored into the signed column, which a non-strict sql_mode clamps to
	// the largest token, with a warning, granting the same token again.
	acquireSQL = `
INSERT INTO {{table}} (` + "`key`" + `, token, held, deadline, owner, value, hold_until)
VALUES (?, ?, 1, {{now}} + INTERVAL ? MICROSECOND, ?, ?, IF(? > 0, {{now}} + INTERVAL ? MICROSECOND, NULL))
ON DUPLICATE KEY UPDATE
	token      = token + IF(LAST_INSERT_ID(IF({{free}}, 3, 2 * (held AND deadline > {{now}} AND owner = VALUES(owner)))) & 1, 1, 0),
	deadline   = IF(LAST_INSERT_ID() & 2,
		IF(LAST_INSERT_ID() & 1, VALUES(deadline), GREATEST(VALUES(deadline), COALESCE(hold_until, VALUES(deadline)))), deadline),
	hold_until = IF(LAST_INSERT_ID() & 1, VALUES(hold_until), hold_until),
	owner      = IF(LAST_INSERT_ID() & 2, VALUES(owner), owner),
	value      = IF(LAST_INSERT_ID() & 2, VALUES(value), value),
	held       = IF(LAST_INSERT_ID() & 2, 1, held)
RETURNING token, held, {{us deadline}}, owner, value, {{us {{now}}}}, COALESCE(hold_until > {{now}}, 0)`

	// firstSQL: a key's first token (no row: new, or reaped) in a batch
	// (acquireBatchSQL), the floor + 1, read from the statement's snapshot
	// (no lock: once per batch statement). Migration 00005's trigger
	// checks an inserted row against the newest committed floor, with a
	// lock, and fails the statement with SQLSTATE 40001 when a reap
	// committed meanwhile; the backend sends it again (docs/key-reaping.md).
	// At the largest token it stays there, so that the acquire of an
	// existing key never fails on the floor's + 1; the trigger then refuses
	// the first row (error 1690, ErrTokenExhausted). firstToken is the
	// same rule for the single acquire's ?2.
	firstSQL = `(SELECT IF(floor < 9223372036854775807, floor + 1, floor) FROM {{floor}} WHERE id = 1)`

	// freeSQL: the key may be granted to a new tenure: its lease expired,
	// or it was released and is past its minimum hold (a release inside
	// it set the deadline to hold_until).
	freeSQL = `(deadline <= {{now}} OR (NOT held AND COALESCE(hold_until, '1970-01-01') <= {{now}}))`

	// floorSQL reads the floor of reaped keys: the newest committed one
	// (autocommit, READ COMMITTED), after a first row the floor refused.
	floorSQL = `SELECT floor FROM {{floor}} WHERE id = 1`

	// reapableSQL: a key whose lease ended (released or expired) at least
	// ? µs ago by the database clock: a grant or renewal moves the deadline
	// to now + TTL, and a release keeps it, so a held, unexpired key never
	// matches; nor does a semaphore's row ("#permit").
	reapableSQL = `deadline <= {{now}} - INTERVAL ? MICROSECOND AND INSTR(` + "`key`" + `, '#permit') = 0`

	// reapPickSQL: ?1 the retention in µs, ?2 the batch's limit. Inside the
	// reaper's READ COMMITTED transaction (see Reap): the rows are locked
	// FOR UPDATE SKIP LOCKED, so a row an acquire, a renewal, a release or
	// a fenced transaction (LOCK IN SHARE MODE) has locked is skipped,
	// never waited for, and reapableSQL is read on the newest committed
	// version of each row it locks. READ COMMITTED takes no gap locks: the
	// scan never makes a first insert wait, and a row it rejects is
	// unlocked at once.
	reapPickSQL = `
SELECT ` + "`key`" + ` FROM {{table}} WHERE {{reapable}} LIMIT ? FOR UPDATE SKIP LOCKED`

	// reapMarkSQL and reapUnmarkSQL open and close the reaper's deletes in
	// its transaction: migration 00006's trigger lets a DELETE through only
	// when the floor row's reaper is the deleting connection's id, which no
	// other transaction ever reads (it is 0 again before the commit). The
	// mark takes the floor row's lock: first inserts (their check reads
	// the floor with a lock) and other reapers wait for this transaction's
	// commit, one short delete later.
	reapMarkSQL   = `UPDATE {{floor}} SET reaper = CONNECTION_ID() WHERE id = 1`
	reapUnmarkSQL = `UPDATE {{floor}} SET reaper = 0 WHERE id = 1`

	// reapDeleteSQL: the picked keys ({{keys}}: one ? each), then the
	// retention in µs. Their rows are locked by the pick, so none changed
	// since; reapableSQL is checked again all the same. Migration 00006's
	// row trigger raises the floor past each row's token before it goes.
	reapDeleteSQL = `
DELETE FROM {{table}} WHERE ` + "`key`" + ` IN ({{keys}}) AND {{reapable}}`

	// renewSQL: ?1 key, ?2 token, ?3 lease in µs, ?4 key again. Extends
	// the lease iff the row holds token ?2, held and unexpired, to now +
	// ?3, or to its hold_until when that is later (no renewal moves a
	// deadline before grant + MinHold). MariaDB 10.11 has no UPDATE ...
	// RETURNING, and an UPDATE's reply does not carry LAST_INSERT_ID(expr)
	// (it says 0: checked on 10.11), so the renewal is an INSERT ...
	// SELECT ... ON DUPLICATE KEY UPDATE ... RETURNING: the SELECT yields
	// the key only when it has a row (so the insert takes the update path
	// and inserts nothing: a row the reaper deleted after the SELECT read
	// it is inserted with the lease's token, at or below the floor, and
	// migration 00005's check refuses it, the resend finding no row), the inserted
	// values carry the request (VALUES(token), VALUES(deadline) = now +
	// ?3), and RETURNING gives the row after the statement, renewed or
	// not: renewed iff token = ?2, held and deadline > now; else token,
	// held and deadline give the exact reason. No row: never granted.
	renewSQL = `
INSERT INTO {{table}} (` + "`key`" + `, token, held, deadline, owner)
SELECT ?, ?, 1, {{now}} + INTERVAL ? MICROSECOND, '' FROM DUAL
WHERE EXISTS (SELECT 1 FROM {{table}} AS c WHERE c.` + "`key`" + ` = ?)
ON DUPLICATE KEY UPDATE
	deadline = IF(token = VALUES(token) AND held AND deadline > {{now}},
		GREATEST(VALUES(deadline), COALESCE(hold_until, '1970-01-01')), deadline)
RETURNING token, held, {{us deadline}}, {{us {{now}}}}`

	// renewBatchSQL is renewSQL for many leases in one statement, at one
	// instant: ?1 is a JSON array of [key, token, lease in µs], one element
	// per key, read by JSON_TABLE (the statement is the same text for
	// every batch size). It is an INSERT ... SELECT ... ON DUPLICATE KEY
	// UPDATE ... RETURNING, because MariaDB's multi-table UPDATE returns
	// nothing: the SELECT keeps only keys that have a row (so each one it
	// keeps takes the update path; a reaped one is refused as in
	// renewSQL), the inserted
	// values carry the request (token, now + lease), and RETURNING gives
	// every such row after the statement, renewed or not, with its key.
	// A key without a row is absent from the result.
	renewBatchSQL = `
INSERT INTO {{table}} (` + "`key`" + `, token, held, deadline, owner)
SELECT r.k, r.tok, 1, {{now}} + INTERVAL r.us MICROSECOND, ''
FROM JSON_TABLE(?, '$[*]' COLUMNS (k VARBINARY(512) PATH '$[0]', tok BIGINT PATH '$[1]', us BIGINT PATH '$[2]')) AS r
WHERE EXISTS (SELECT 1 FROM {{table}} AS c WHERE c.` + "`key`" + ` = r.k)
ON DUPLICATE KEY UPDATE
	deadline = IF(token = VALUES(token) AND held AND deadline > {{now}},
		GREATEST(VALUES(deadline), COALESCE(hold_until, '1970-01-01')), deadline)
RETURNING ` + "`key`" + `, token, held, {{us deadline}}, {{us {{now}}}}`

	// releaseHeldSQL: ?1 owner, ?2 the same, ?3 the same, ?4 key, ?5
	// token. The common release, of a lease held and unexpired: a plain
	// UPDATE, whose reply (an OK packet, no result set) says by its
	// affected rows whether it cleared the lease: 1 iff the row held token
	// ?5, held and unexpired (held changes from 1 to 0, so a match always
	// changes the row; the driver's clientFoundRows does not matter). The
	// assignments read only columns not yet assigned (see acquireSQL):
	// deadline first (it reads owner and hold_until), owner last. A
	// release by the holder itself before its hold_until (MinHold) keeps
	// the key taken until then: the deadline becomes hold_until; another
	// owner's (a forced release) clears hold_until. When it clears nothing
	// (expired, released already, a newer token, no row), releaseSQL runs:
	// one round trip more, on the rare path only.
	releaseHeldSQL = `
UPDATE {{table}} SET
	deadline   = IF(owner = ? AND hold_until > {{now}}, hold_until, deadline),
	hold_until = IF(owner = ?, hold_until, NULL),
	held       = 0,
	owner      = ?
WHERE ` + "`key`" + ` = ? AND token = ? AND held AND deadline > {{now}}`

	// releaseSQL: ?1 key, ?2 token, ?3 owner, ?4 key again. The release
	// when releaseHeldSQL cleared nothing; on its own it is a complete
	// release (the tests run it alone too). Clears held
	// iff ?2 is the current token and held, and records ?3 as who
	// released. A release by the holder itself before its hold_until
	// (MinHold) keeps the key taken until then: the deadline becomes
	// hold_until, which freeSQL reads; another owner's (a forced release)
	// clears hold_until, so the key is free at once. The shape is
	// renewSQL's (no UPDATE ... RETURNING). As in acquireSQL, the first
	// assignment takes the decision on the row as it was, into
	// LAST_INSERT_ID(expr): bit 2 it is cleared now (token ?2 and held),
	// bit 1 its deadline had passed; the later assignments read it and
	// only columns not yet assigned, and RETURNING gives both bits with the
	// row after the statement, so "released twice by its owner", a loss
	// and its reason come from the same round trip. No row: never granted.
	releaseSQL = `
INSERT INTO {{table}} (` + "`key`" + `, token, held, deadline, owner)
SELECT ?, ?, 0, {{now}}, ? FROM DUAL
WHERE EXISTS (SELECT 1 FROM {{table}} AS c WHERE c.` + "`key`" + ` = ?)
ON DUPLICATE KEY UPDATE
	token      = IF(LAST_INSERT_ID(2 * (token = VALUES(token) AND held) + (deadline <= {{now}})) >= 0, token, token),
	deadline   = IF(LAST_INSERT_ID() & 2 AND owner = VALUES(owner) AND hold_until > {{now}} AND deadline > {{now}}, hold_until, deadline),
	hold_until = IF(LAST_INSERT_ID() & 2 AND owner <> VALUES(owner), NULL, hold_until),
	held       = IF(LAST_INSERT_ID() & 2, 0, held),
	owner      = IF(LAST_INSERT_ID() & 2, VALUES(owner), owner)
RETURNING token, held, owner, {{us deadline}}, {{us {{now}}}}, LAST_INSERT_ID() & 2 = 2, LAST_INSERT_ID() & 1`

	// listSQL: ?1 prefix, ?2 the first string after every string that
	// starts with ?1 (see prefixEnd). Keys are VARBINARY, compared byte by
	// byte, so [?1, ?2) is exactly the keys with that prefix, an index
	// range on the primary key. No LIKE, so no wildcard hides in a prefix.
	listSQL = `
SELECT ` + "`key`" + `, token, owner, (held OR COALESCE(hold_until > {{now}}, 0)) AND deadline > {{now}}, {{us deadline}}, {{us {{now}}}}, value
FROM {{table}} WHERE ` + "`key`" + ` >= ? AND ` + "`key`" + ` < ? ORDER BY ` + "`key`"

	// listFromSQL: ?1 prefix, when no string bounds it from above.
	listFromSQL = `
SELECT ` + "`key`" + `, token, owner, (held OR COALESCE(hold_until > {{now}}, 0)) AND deadline > {{now}}, {{us deadline}}, {{us {{now}}}}, value
FROM {{table}} WHERE ` + "`key`" + ` >= ? ORDER BY ` + "`key`"

	// fenceSQL: ?1 token, ?2 key. Inside the caller's transaction: the row
	// locked in share mode, so no grant, renewal or release can change it
	// until the transaction ends, and 1 iff the lease is current, held
	// and unexpired.
	fenceSQL = `
SELECT token = ? AND held AND deadline > {{now}}, token, held, {{us deadline}}, owner, {{us {{now}}}}
FROM {{table}} WHERE ` + "`key`" + ` = ?
LOCK IN SHARE MODE`
)

// acquireBatchSQL is acquireSQL for many keys in one statement and one
// commit, at one instant of the database clock (group commit, see
// groupcommit.go): ?1 is a JSON array of [key, lease in µs, owner, value
// in base64 or null for none, min hold in µs (0 for none)], one element
// per key, in key order, read by JSON_TABLE (one statement text for every
// batch size). Its rows are acquireSQL's VALUES (a first token above the
// floor, firstSQL, and migration 00005's check of every inserted row), and its ON DUPLICATE KEY
// UPDATE clause and RETURNING are acquireSQL's, taken from its text (a
// change to one is a change to both): the server applies the clause row
// by row, in the array's order, each row's first assignment taking its
// decision into LAST_INSERT_ID(expr) before the row's later assignments
// read it, and RETURNING gives each row after the statement, with its key
// first.
var acquireBatchSQL = batchOfAcquire(acquireSQL)

// batchOfAcquire is acquireBatchSQL made from single (acquireSQL).
func batchOfAcquire(single string) string {
	head, rest, ok1 := strings.Cut(single, "\nVALUES (")
	_, update, ok2 := strings.Cut(rest, "\nON DUPLICATE KEY UPDATE\n")
	update, returning, ok3 := strings.Cut(update, "\nRETURNING ")
	if !ok1 || !ok2 || !ok3 {
		panic("sqllock/mariadb: acquireSQL lost the shape that acquireBatchSQL is made from")
	}
	return head + `
SELECT r.k, {{first}}, 1, {{now}} + INTERVAL r.us MICROSECOND, r.o, FROM_BASE64(r.v), IF(r.h > 0, {{now}} + INTERVAL r.h MICROSECOND, NULL)
FROM JSON_TABLE(?, '$[*]' COLUMNS (k VARBINARY(512) PATH '$[0]', us BIGINT PATH '$[1]', o VARBINARY(512) PATH '$[2]',
	v VARCHAR(8192) PATH '$[3]', h BIGINT PATH '$[4]')) AS r
ON DUPLICATE KEY UPDATE
` + update + "\nRETURNING `key`, " + returning
}

// releaseBatchSQL is releaseSQL for many leases in one statement and one
// commit, at one instant (group commit): ?1 is a JSON array of [key,
// token, owner], one element per key, in key order. Its ON DUPLICATE KEY
// UPDATE clause and RETURNING are releaseSQL's, taken from its text, with
// the key first in RETURNING; the SELECT keeps only keys that have a row,
// so that it never inserts: a key without a row is absent from the result.
var releaseBatchSQL = batchOfRelease(releaseSQL)

// batchOfRelease is releaseBatchSQL made from single (releaseSQL).
func batchOfRelease(single string) string {
	head, rest, ok1 := strings.Cut(single, "\nSELECT ?, ?, 0, {{now}}, ? FROM DUAL\n")
	_, update, ok2 := strings.Cut(rest, "\nON DUPLICATE KEY UPDATE\n")
	update, returning, ok3 := strings.Cut(update, "\nRETURNING ")
	if !ok1 || !ok2 || !ok3 {
		panic("sqllock/mariadb: releaseSQL lost the shape that releaseBatchSQL is made from")
	}
	return head + `
SELECT r.k, r.tok, 0, {{now}}, r.o
FROM JSON_TABLE(?, '$[*]' COLUMNS (k VARBINARY(512) PATH '$[0]', tok BIGINT PATH '$[1]', o VARBINARY(512) PATH '$[2]')) AS r
WHERE EXISTS (SELECT 1 FROM {{table}} AS c WHERE c.` + "`key`" + ` = r.k)
ON DUPLICATE KEY UPDATE
` + update + "\nRETURNING `key`, " + returning
}

// lockWaitPrefix is stmtPrefix for a lock wait of lockWait seconds, or
// nothing when the session's innodb_lock_wait_timeout, as New read it, is
// that already (set by the DSN for every connection, or the server's
// default): SET STATEMENT costs the server a variable's change and
// restore at each execution, measured at 10–15% of an acquire and release
// pair's throughput at 8 to 16 goroutines (bench/, raw-lockwait).
func lockWaitPrefix(lockWait string, sessionWait int64) string {
	if lockWait == strconv.FormatInt(sessionWait, 10) {
		return ""
	}
	return strings.ReplaceAll(stmtPrefix, "{{lockwait}}", lockWait)
}

// render fills in a statement for table (unquoted) and the clock
// expression now, after prefix (lockWaitPrefix).
func render(q, table, now, prefix string) string {
	return prefix + renderBare(q, table, now)
}

// renderBare fills in a statement to run inside the caller's transaction
// (no stmtPrefix: the transaction's own settings apply).
func renderBare(q, table, now string) string {
	q = strings.ReplaceAll(q, "{{free}}", freeSQL)
	q = strings.ReplaceAll(q, "{{first}}", firstSQL)
	q = strings.ReplaceAll(q, "{{reapable}}", reapableSQL)
	q = strings.ReplaceAll(q, "{{floor}}", sqlident.QuoteMariaDB(table+floorSuffix))
	q = strings.ReplaceAll(q, "{{us {{now}}}}", "TIMESTAMPDIFF(MICROSECOND, '1970-01-01', "+now+")")
	q = strings.ReplaceAll(q, "{{us deadline}}", "TIMESTAMPDIFF(MICROSECOND, '1970-01-01', deadline)")
	q = strings.ReplaceAll(q, "{{now}}", now)
	q = strings.ReplaceAll(q, "{{table}}", sqlident.QuoteMariaDB(table))
	return strings.TrimSpace(q)
}
