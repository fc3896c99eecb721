package sqlite

import "strings"

// nowMS is SQLite's clock in integer Unix milliseconds. SQLite evaluates
// 'now' once per sqlite3_step, so every use in one statement (SET, WHERE,
// RETURNING) sees the same instant. unixepoch('subsec') is a double with
// millisecond resolution; ROUND makes the ×1000 exact.
const nowMS = `CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER)`

// maxToken is the largest token; tokens never wrap.
const maxToken = `9223372036854775807`

// The statements, with {{table}} for the quoted table, {{now}} for [nowMS]
// and {{grant}} for grantSQL (as dialect/postgres names its parts). Each
// operation is one statement in autocommit mode (the common release path
// too; see releaseSQL).
//
// A note on "always-matching" updates: SQLite's b-tree does not rewrite a
// cell whose new content is byte-for-byte the old one, so an UPDATE (or the
// DO UPDATE of an upsert) that sets every column to its current value
// dirties no page and commits no WAL frame. acquireSQL and renewSQL use
// that: when they may not change anything they set the row to itself and
// still RETURN it, so the caller learns the holder (or why the lease is
// lost) from the same statement, and a refused attempt writes nothing
// (TestRefusedOperationsWriteNothing checks it with PRAGMA data_version).
// Like any write statement they take SQLite's write lock for their
// duration, which is microseconds when nothing is written.
const (
	// acquireSQL: ?1 key, ?2 ttl in ms (rounded up), ?3 owner, ?4 value
	// (NULL for none; migration 00003's column), ?5 min hold in ms
	// (rounded up; 0 for none): a grant's deadline is now + max(?2, ?5) and
	// its hold_until (migration 00004) now + ?5, so a holder that crashes
	// keeps the key until the later of the two. The last column says
	// whether a released row is still inside its min hold (taken).
	//
	// A grant happens iff the key is free (no row, released, or deadline <=
	// now) and its token is below the largest int64, or the key is held,
	// unexpired, by the same owner (a retry after a lost reply: same token,
	// deadline extended). Otherwise the row is set to itself and returned
	// unchanged. The caller tells a grant by the returned row: held, owner =
	// ?3, deadline > now (a refused row has another owner, or is free with
	// the token exhausted).
	//
	// token + (free AND token < max) adds 1 exactly on a new tenure and never
	// overflows; free and "held by the same owner" exclude each other.
	//
	// The inserted row carries the key's current token (1 for a new key):
	// migration 00002's BEFORE INSERT trigger, which refuses a REPLACE that
	// would lower a token, sees the upsert's VALUES too, so they must not be
	// lower than the row the DO UPDATE then changes.
	acquireSQL = `
INSERT INTO {{table}} (key, token, held, deadline, owner, value, hold_until)
VALUES (?1, coalesce((SELECT token FROM {{table}} WHERE key = ?1), 1), 1, {{now}} + max(?2, ?5), ?3, ?4, CASE WHEN ?5 > 0 THEN {{now}} + ?5 END)
ON CONFLICT (key) DO UPDATE SET
	token    = token + ({{free}} AND token < ` + maxToken + `),
	held     = CASE WHEN {{grant}} THEN 1 ELSE held END,
	deadline = CASE WHEN {{grant}} THEN max(excluded.deadline, CASE WHEN owner = excluded.owner THEN coalesce(hold_until, 0) ELSE 0 END) ELSE deadline END,
	hold_until = CASE WHEN {{grant}} AND owner <> excluded.owner THEN excluded.hold_until ELSE hold_until END,
	owner    = CASE WHEN {{grant}} THEN excluded.owner ELSE owner END,
	value    = CASE WHEN {{grant}} THEN excluded.value ELSE value END
RETURNING token, held, deadline, owner, value, {{now}}, coalesce(hold_until > {{now}}, 0)`

	// grantSQL is the DO UPDATE grant condition over the existing row.
	grantSQL = `(({{free}} AND token < ` + maxToken + `)` +
		` OR (held AND deadline > {{now}} AND owner = excluded.owner))`

	// freeSQL: the key may be granted to a new tenure: its lease expired,
	// or it was released and is past its minimum hold (migration 00004's
	// hold_until; a release inside it set the deadline to it).
	freeSQL = `(deadline <= {{now}} OR (NOT held AND coalesce(hold_until, 0) <= {{now}}))`

	// renewSQL: ?1 key, ?2 token, ?3 ttl in ms. Extends iff the row holds
	// token ?2, held and unexpired; otherwise sets the row to itself. The
	// returned row tells which: renewed iff token = ?2, held and deadline >
	// now; else the returned token, held and deadline give the exact reason
	// (taken by a newer token, released, expired). No row: the key was never
	// granted.
	renewSQL = `
UPDATE {{table}} SET deadline = CASE
	WHEN token = ?2 AND held AND deadline > {{now}} THEN max({{now}} + ?3, coalesce(hold_until, 0))
	ELSE deadline END
WHERE key = ?1
RETURNING token, held, deadline, {{now}}`

	// renewBatchSQL is renewSQL for many leases in one statement, at one
	// given instant, ?2 (ms), read once for the whole batch (nowSQL) inside
	// its write transaction. ?1 is a JSON array of [key, token, ttl in ms],
	// one element per key: json_each reads it, so the statement is the same
	// text for every batch size and binds two parameters, not three per
	// lease. The instant is from before the statement, so the deadline it
	// sets is earlier than renewSQL's would be, never later; max() keeps a
	// later deadline that a lease already has (a deadline never moves back).
	// As in renewSQL, a row that is not renewed is set to itself (which
	// writes nothing) and still returned, with its key: the caller tells a
	// renewal from the returned token, held and deadline, and a key with no
	// row from its absence. The join reaches each row through the primary
	// key (TestRenewBatchPlan).
	renewBatchSQL = `
UPDATE {{table}} AS l SET deadline = CASE
	WHEN l.token = r.token AND l.held AND l.deadline > ?2 THEN max(l.deadline, ?2 + r.ms)
	ELSE l.deadline END
FROM (SELECT j.value ->> 0 AS key, j.value ->> 1 AS token, j.value ->> 2 AS ms FROM json_each(?1) AS j) AS r
WHERE l.key = r.key
RETURNING key, token, held, deadline`

	// nowSQL reads the database clock.
	nowSQL = `SELECT {{now}}`

	// releaseSQL: ?1 key, ?2 token, ?3 owner. Clears held iff ?2 is the
	// current token and held, and records ?3 as who released. A release by
	// the holder itself before its hold_until (MinHold) keeps the key taken
	// until then: the deadline becomes hold_until, which acquireSQL's
	// freeSQL reads; another owner's (a forced release) clears hold_until,
	// so the key is free at once. The SET expressions read the row as it
	// was (the holder's owner, not ?3). It returns the deadline so the caller knows whether the
	// lease had expired (deadline <= now) before it was released. No row
	// means nothing to clear: released already, a newer token, or no such
	// key; only then does the caller read the row (peekSQL) to tell which,
	// because the old held flag that separates "released twice" from
	// "expired" is gone once the statement has run.
	releaseSQL = `
UPDATE {{table}} SET held = 0, owner = ?3,
	deadline   = CASE WHEN owner = ?3 AND hold_until > {{now}} AND deadline > {{now}} THEN hold_until ELSE deadline END,
	hold_until = CASE WHEN owner = ?3 THEN hold_until END
WHERE key = ?1 AND token = ?2 AND held
RETURNING deadline, {{now}}`

	// peekSQL: ?1 key. The row as it is now (read-only).
	peekSQL = `SELECT token, held, deadline, owner, {{now}} FROM {{table}} WHERE key = ?1`

	// listSQL: ?1 prefix, ?2 the first string after every string that
	// starts with ?1 (see prefixEnd). Keys compare with SQLite's BINARY
	// collation (memcmp), so [?1, ?2) is exactly the keys with that byte
	// prefix, and it is an index range on the primary key. No LIKE, so no
	// wildcard can hide in a prefix.
	listSQL = `
SELECT key, token, owner, (held OR coalesce(hold_until > {{now}}, 0)) AND deadline > {{now}}, deadline, {{now}}, value
FROM {{table}} WHERE key >= ?1 AND key < ?2 ORDER BY key`

	// listFromSQL: ?1 prefix, when no string bounds it from above (the
	// empty prefix).
	listFromSQL = `
SELECT key, token, owner, (held OR coalesce(hold_until > {{now}}, 0)) AND deadline > {{now}}, deadline, {{now}}, value
FROM {{table}} WHERE key >= ?1 ORDER BY key`

	// expireSQL (tests): the lease's deadline becomes now; token and held
	// stay as they are.
	expireSQL = `UPDATE {{table}} SET deadline = {{now}} WHERE key = ?1`

	// setTokenSQL (tests): ?1 key, ?2 token. The key exists, released,
	// with that token.
	setTokenSQL = `
INSERT INTO {{table}} (key, token, held, deadline, owner) VALUES (?1, ?2, 0, {{now}}, '')
ON CONFLICT (key) DO UPDATE SET token = excluded.token, held = 0, deadline = excluded.deadline`
)

// render fills in a statement for the quoted table and the clock
// expression now ([nowMS] but in tests).
func render(q, quotedTable, now string) string {
	q = strings.ReplaceAll(q, "{{grant}}", grantSQL)
	q = strings.ReplaceAll(q, "{{free}}", freeSQL)
	q = strings.ReplaceAll(q, "{{now}}", now)
	return strings.TrimSpace(strings.ReplaceAll(q, "{{table}}", quotedTable))
}

// prefixEnd returns the smallest string greater than every string that
// starts with prefix, and false when there is none (prefix empty or all
// 0xff bytes; valid UTF-8 never contains 0xff).
func prefixEnd(prefix string) (string, bool) {
	b := []byte(prefix)
	for i := len(b) - 1; i >= 0; i-- {
		if b[i] < 0xff {
			b[i]++
			return string(b[:i+1]), true
		}
	}
	return "", false
}
