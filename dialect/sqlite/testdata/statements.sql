-- acquire
INSERT INTO "sqllock_locks" (key, token, held, deadline, owner, value, hold_until)
VALUES (?1, coalesce((SELECT token FROM "sqllock_locks" WHERE key = ?1), (SELECT floor + 1 FROM "sqllock_locks_floor")), 1, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) + max(?2, ?5), ?3, ?4, CASE WHEN ?5 > 0 THEN CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) + ?5 END)
ON CONFLICT (key) DO UPDATE SET
	token    = token + ((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807),
	held     = CASE WHEN (((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) OR (held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = excluded.owner)) THEN 1 ELSE held END,
	deadline = CASE WHEN (((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) OR (held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = excluded.owner)) THEN max(excluded.deadline, CASE WHEN owner = excluded.owner THEN coalesce(hold_until, 0) ELSE 0 END) ELSE deadline END,
	hold_until = CASE WHEN ((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) THEN excluded.hold_until ELSE hold_until END,
	owner    = CASE WHEN (((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) OR (held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = excluded.owner)) THEN excluded.owner ELSE owner END,
	value    = CASE WHEN (((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) OR (held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = excluded.owner)) THEN excluded.value ELSE value END
RETURNING token, held, deadline, owner, value, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), coalesce(hold_until > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), 0), shared,
	coalesce(CASE WHEN mark_deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) THEN mark_owner END, '')

-- renew
UPDATE "sqllock_locks" SET deadline = CASE
	WHEN token = ?2 AND held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) THEN max(CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) + ?3, coalesce(hold_until, 0))
	ELSE deadline END
WHERE key = ?1
RETURNING token, held, deadline, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER)

-- renew_batch
UPDATE "sqllock_locks" AS l SET deadline = CASE
	WHEN l.token = r.token AND l.held AND l.deadline > ?2 THEN max(l.deadline, ?2 + r.ms)
	ELSE l.deadline END
FROM (SELECT j.value ->> 0 AS key, j.value ->> 1 AS token, j.value ->> 2 AS ms FROM json_each(?1) AS j) AS r
WHERE l.key = r.key
RETURNING key, token, held, deadline

-- now
SELECT CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER)

-- release
UPDATE "sqllock_locks" SET held = 0, owner = ?3,
	deadline   = CASE WHEN owner = ?3 AND hold_until > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) THEN hold_until ELSE deadline END,
	hold_until = CASE WHEN owner = ?3 THEN hold_until END
WHERE key = ?1 AND token = ?2 AND held
RETURNING deadline, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER)

-- peek
SELECT token, held, deadline, owner, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) FROM "sqllock_locks" WHERE key = ?1

-- list
SELECT key, token, owner, (held OR coalesce(hold_until > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), 0)) AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), deadline, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), value,
	CASE WHEN held AND owner = '' AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) THEN shared ELSE 0 END,
	coalesce(CASE WHEN mark_deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) THEN mark_owner END, '')
FROM "sqllock_locks" WHERE key >= ?1 AND key < ?2 ORDER BY key

-- list_from
SELECT key, token, owner, (held OR coalesce(hold_until > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), 0)) AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), deadline, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), value,
	CASE WHEN held AND owner = '' AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) THEN shared ELSE 0 END,
	coalesce(CASE WHEN mark_deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) THEN mark_owner END, '')
FROM "sqllock_locks" WHERE key >= ?1 ORDER BY key

-- permit_acquire
WITH RECURSIVE p(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM p WHERE i < ?5)
UPDATE "sqllock_locks" SET
	token      = CASE WHEN held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = ?3 THEN token ELSE token + 1 END,
	value      = CASE WHEN held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = ?3 THEN value ELSE ?4 END,
	held       = 1,
	deadline   = CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) + ?2,
	owner      = ?3,
	hold_until = NULL
WHERE key = (
	SELECT c.key FROM p JOIN "sqllock_locks" AS c ON c.key = ?1 || '#permit-' || p.i
	WHERE (c.held AND c.deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND c.owner = ?3)
	   OR ((NOT c.held OR c.deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER)) AND c.token < 9223372036854775807)
	ORDER BY c.held AND c.deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND c.owner = ?3 DESC, p.i
	LIMIT 1)
  AND EXISTS (SELECT 1 FROM "sqllock_locks" WHERE key = ?1 || '#permits' AND token = ?5)
RETURNING key, token, deadline, value, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER)

-- permit_peek
WITH RECURSIVE p(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM p WHERE i < ?2)
SELECT key, token, held, deadline, owner, value, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) FROM "sqllock_locks"
WHERE key = ?1 || '#permits' OR key IN (SELECT ?1 || '#permit-' || i FROM p)

-- permit_create
WITH RECURSIVE p(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM p WHERE i < ?2)
INSERT INTO "sqllock_locks" (key, token, held, deadline, owner)
SELECT ?1 || '#permits', ?2, 0, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), ''
WHERE NOT EXISTS (SELECT 1 FROM "sqllock_locks" WHERE key = ?1 || '#permits')
UNION ALL
SELECT ?1 || '#permit-' || i, 1, 0, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), '' FROM p
WHERE NOT EXISTS (SELECT 1 FROM "sqllock_locks" WHERE key = ?1 || '#permits')
ON CONFLICT DO NOTHING

-- acquire_all
WITH blocked AS (
	SELECT t.key FROM json_each(?1) AS k JOIN "sqllock_locks" AS t ON t.key = k.value
	WHERE NOT (((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) OR (t.held AND t.deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND t.owner = ?3))
)
INSERT INTO "sqllock_locks" (key, token, held, deadline, owner, value, hold_until)
SELECT s.key, coalesce((SELECT c.token FROM "sqllock_locks" AS c WHERE c.key = s.key), (SELECT f.floor + 1 FROM "sqllock_locks_floor" AS f)),
	NOT EXISTS (SELECT 1 FROM blocked), CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) + ?2, ?3, ?4, NULL
FROM (SELECT j.value AS key FROM json_each(?1) AS j) AS s
WHERE NOT EXISTS (SELECT 1 FROM blocked) OR s.key = (SELECT min(b.key) FROM blocked AS b)
ORDER BY s.key
ON CONFLICT (key) DO UPDATE SET
	token    = token + (excluded.held AND ((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807)),
	held     = CASE WHEN excluded.held AND (((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) OR (held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = excluded.owner)) THEN 1 ELSE held END,
	deadline = CASE WHEN excluded.held AND (((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) OR (held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = excluded.owner)) THEN max(excluded.deadline, CASE WHEN owner = excluded.owner THEN coalesce(hold_until, 0) ELSE 0 END) ELSE deadline END,
	hold_until = CASE WHEN excluded.held AND ((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) THEN NULL ELSE hold_until END,
	owner    = CASE WHEN excluded.held AND (((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) OR (held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = excluded.owner)) THEN excluded.owner ELSE owner END,
	value    = CASE WHEN excluded.held AND (((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) OR (held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = excluded.owner)) THEN excluded.value ELSE value END
RETURNING key, token, held, deadline, owner, value, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), coalesce(hold_until > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), 0)

-- release_all
UPDATE "sqllock_locks" AS l SET held = 0, owner = r.owner,
	deadline   = CASE WHEN l.owner = r.owner AND l.hold_until > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND l.deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) THEN l.hold_until ELSE l.deadline END,
	hold_until = CASE WHEN l.owner = r.owner THEN l.hold_until END
FROM (SELECT j.value ->> 0 AS key, j.value ->> 1 AS token, j.value ->> 2 AS owner FROM json_each(?1) AS j) AS r
WHERE l.key = r.key AND l.token = r.token AND l.held
RETURNING key, deadline, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER)

-- reap_begin
UPDATE "sqllock_locks_floor" SET reaping = 1

-- reap
DELETE FROM "sqllock_locks"
WHERE key IN (
    SELECT c.key FROM "sqllock_locks" AS c
    WHERE c.deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) - ?1 AND c.key NOT LIKE '%#permit%' AND c.key NOT LIKE '%#shared-%'
    ORDER BY c.key
    LIMIT ?2)
  AND deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) - ?1

-- reap_end
UPDATE "sqllock_locks_floor" SET reaping = 0

-- acquire_mark
INSERT INTO "sqllock_locks" (key, token, held, deadline, owner, value, hold_until)
VALUES (?1, coalesce((SELECT token FROM "sqllock_locks" WHERE key = ?1), (SELECT floor + 1 FROM "sqllock_locks_floor")), 1, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) + max(?2, ?5), ?3, ?4, CASE WHEN ?5 > 0 THEN CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) + ?5 END)
ON CONFLICT (key) DO UPDATE SET
	token    = token + ((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807),
	held     = CASE WHEN (((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) OR (held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = excluded.owner)) THEN 1 ELSE held END,
	deadline = CASE WHEN (((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) OR (held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = excluded.owner)) THEN max(excluded.deadline, CASE WHEN owner = excluded.owner THEN coalesce(hold_until, 0) ELSE 0 END) ELSE deadline END,
	hold_until = CASE WHEN ((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) THEN excluded.hold_until ELSE hold_until END,
	owner    = CASE WHEN (((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) OR (held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = excluded.owner)) THEN excluded.owner ELSE owner END,
	value    = CASE WHEN (((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) OR (held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = excluded.owner)) THEN excluded.value ELSE value END,
	mark_owner = CASE
		WHEN (((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) OR (held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = excluded.owner)) THEN CASE WHEN mark_owner = excluded.owner THEN NULL ELSE mark_owner END
		WHEN mark_owner IS NULL OR coalesce(mark_deadline, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR mark_owner = excluded.owner THEN excluded.owner
		ELSE mark_owner END,
	mark_deadline = CASE
		WHEN (((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) OR (held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = excluded.owner)) THEN CASE WHEN mark_owner = excluded.owner THEN NULL ELSE mark_deadline END
		WHEN mark_owner IS NULL OR coalesce(mark_deadline, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR mark_owner = excluded.owner THEN CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) + ?2
		ELSE mark_deadline END
RETURNING token, held, deadline, owner, value, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), coalesce(hold_until > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), 0), shared,
	coalesce(CASE WHEN mark_deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) THEN mark_owner END, '')

-- shared_acquire
WITH RECURSIVE
k AS (
	SELECT coalesce(t.token, (SELECT floor FROM "sqllock_locks_floor")) AS token, coalesce(t.held, 0) AS held, coalesce(t.deadline, 0) AS deadline,
		coalesce(t.owner, '') AS owner, t.value AS value, t.hold_until AS hold_until,
		coalesce(t.shared, 0) AS shared, coalesce(t.epoch, 0) AS epoch, coalesce(t.slots, 0) AS slots,
		t.mark_owner AS mark_owner, t.mark_deadline AS mark_deadline,
		coalesce(t.held AND t.owner = '' AND t.deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), 0) AS live
	FROM (SELECT 1) LEFT JOIN "sqllock_locks" AS t ON t.key = ?1),
p(i) AS (SELECT 1 UNION ALL SELECT p.i + 1 FROM p, k WHERE p.i < k.slots),
c AS (
	SELECT p.i AS i, s.token AS token, s.value AS value,
		(k.live AND s.held AND s.deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND s.owner = ?3 AND s.token >= k.epoch) AS retry,
		(k.live AND s.held AND s.token >= k.epoch) AS counted
	FROM p, k JOIN "sqllock_locks" AS s ON s.key = ?1 || '#shared-' || p.i
	WHERE (k.live AND s.held AND s.deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND s.owner = ?3 AND s.token >= k.epoch)
		OR NOT k.live OR NOT s.held OR s.deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR s.token < k.epoch),
pick AS (
	SELECT i, token, value, retry, counted FROM c
	UNION ALL SELECT k.slots + 1, 0, NULL, 0, 0 FROM k WHERE k.slots < 1024
	ORDER BY retry DESC, i LIMIT 1),
g AS (
	SELECT k.*, pick.i AS i, pick.token AS stoken, pick.value AS svalue, pick.counted AS counted,
		CASE
			WHEN pick.retry THEN 1
			WHEN NOT k.live AND ((k.held AND k.deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))
				OR (NOT k.held AND coalesce(k.hold_until, 0) > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND k.deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) THEN 0
			WHEN k.mark_owner IS NOT NULL AND k.mark_deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) THEN 0
			WHEN pick.i IS NULL THEN 0
			WHEN max(k.token, pick.token) >= 9223372036854775807 THEN 0
			ELSE 2 END AS act,
		CASE WHEN max(k.token, coalesce(pick.token, 0)) < 9223372036854775807 THEN max(k.token, coalesce(pick.token, 0)) + 1 END AS t
	FROM k LEFT JOIN pick)
INSERT INTO "sqllock_locks" (key, token, held, deadline, owner, value, hold_until, shared, epoch, slots, mark_owner, mark_deadline)
SELECT ?1,
	CASE act WHEN 2 THEN t ELSE token END,
	CASE act WHEN 0 THEN held ELSE 1 END,
	CASE WHEN act = 0 THEN deadline WHEN live THEN max(deadline, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) + ?2) ELSE CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) + ?2 END,
	CASE act WHEN 0 THEN owner ELSE '' END,
	CASE act WHEN 0 THEN value END,
	CASE act WHEN 0 THEN hold_until END,
	CASE WHEN act <> 2 THEN shared WHEN NOT live THEN 1 WHEN counted THEN shared ELSE shared + 1 END,
	CASE WHEN act = 2 AND NOT live THEN t ELSE epoch END,
	CASE act WHEN 2 THEN max(slots, i) ELSE slots END,
	mark_owner, mark_deadline
FROM g
UNION ALL
SELECT ?1 || '#shared-' || i, CASE act WHEN 1 THEN stoken ELSE t END, 1, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) + ?2, ?3,
	CASE act WHEN 1 THEN svalue ELSE ?4 END, NULL, 0, 0, 0, NULL, NULL
FROM g WHERE act > 0
ON CONFLICT (key) DO UPDATE SET
	token = excluded.token, held = excluded.held, deadline = excluded.deadline, owner = excluded.owner,
	value = excluded.value, hold_until = excluded.hold_until, shared = excluded.shared, epoch = excluded.epoch,
	slots = excluded.slots, mark_owner = excluded.mark_owner, mark_deadline = excluded.mark_deadline
RETURNING key, token, held, deadline, owner, value, coalesce(hold_until, 0), shared, coalesce(mark_owner, ''), coalesce(mark_deadline, 0), CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER)

-- shared_renew
WITH v AS (SELECT
	coalesce((SELECT s.held AND s.deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND s.token = ?2 FROM "sqllock_locks" AS s WHERE s.key = ?1), 0)
	AND coalesce((SELECT k.held AND k.owner = '' AND k.deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND k.epoch <= ?2 FROM "sqllock_locks" AS k WHERE k.key = ?4), 0) AS ok)
INSERT INTO "sqllock_locks" (key, token, held, deadline, owner)
SELECT t.key, t.token, t.held,
	CASE WHEN NOT v.ok THEN t.deadline WHEN t.key = ?1 THEN CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) + ?3 ELSE max(t.deadline, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) + ?3) END,
	t.owner
FROM "sqllock_locks" AS t, v WHERE t.key IN (?1, ?4)
ON CONFLICT (key) DO UPDATE SET deadline = excluded.deadline
RETURNING key, token, held, deadline, owner, epoch, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER)

-- shared_release
WITH v AS (SELECT
	coalesce((SELECT s.held AND s.token = ?2 FROM "sqllock_locks" AS s WHERE s.key = ?1), 0) AS rel,
	coalesce((SELECT k.held AND k.owner = '' AND k.epoch <= ?2 FROM "sqllock_locks" AS k WHERE k.key = ?4), 0) AS dec)
INSERT INTO "sqllock_locks" (key, token, held, deadline, owner, shared)
SELECT t.key, t.token,
	CASE WHEN NOT v.rel THEN t.held WHEN t.key = ?1 THEN 0 WHEN v.dec AND t.shared <= 1 THEN 0 ELSE t.held END,
	t.deadline,
	CASE WHEN v.rel AND t.key = ?1 THEN ?3 ELSE t.owner END,
	CASE WHEN v.rel AND v.dec AND t.key = ?4 THEN max(t.shared - 1, 0) ELSE t.shared END
FROM "sqllock_locks" AS t, v WHERE t.key IN (?1, ?4)
ON CONFLICT (key) DO UPDATE SET held = excluded.held, owner = excluded.owner, shared = excluded.shared
RETURNING key, token, held, deadline, owner, shared, epoch, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER)

