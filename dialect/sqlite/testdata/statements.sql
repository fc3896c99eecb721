-- acquire
INSERT INTO "sqllock_locks" (key, token, held, deadline, owner, value, hold_until)
VALUES (?1, coalesce((SELECT token FROM "sqllock_locks" WHERE key = ?1), 1), 1, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) + max(?2, ?5), ?3, ?4, CASE WHEN ?5 > 0 THEN CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) + ?5 END)
ON CONFLICT (key) DO UPDATE SET
	token    = token + ((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807),
	held     = CASE WHEN (((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) OR (held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = excluded.owner)) THEN 1 ELSE held END,
	deadline = CASE WHEN (((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) OR (held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = excluded.owner)) THEN max(excluded.deadline, CASE WHEN owner = excluded.owner THEN coalesce(hold_until, 0) ELSE 0 END) ELSE deadline END,
	hold_until = CASE WHEN ((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) THEN excluded.hold_until ELSE hold_until END,
	owner    = CASE WHEN (((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) OR (held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = excluded.owner)) THEN excluded.owner ELSE owner END,
	value    = CASE WHEN (((deadline <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) OR (NOT held AND coalesce(hold_until, 0) <= CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER))) AND token < 9223372036854775807) OR (held AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER) AND owner = excluded.owner)) THEN excluded.value ELSE value END
RETURNING token, held, deadline, owner, value, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), coalesce(hold_until > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), 0)

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
SELECT key, token, owner, (held OR coalesce(hold_until > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), 0)) AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), deadline, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), value
FROM "sqllock_locks" WHERE key >= ?1 AND key < ?2 ORDER BY key

-- list_from
SELECT key, token, owner, (held OR coalesce(hold_until > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), 0)) AND deadline > CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), deadline, CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER), value
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
SELECT s.key, coalesce((SELECT c.token FROM "sqllock_locks" AS c WHERE c.key = s.key), 1),
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

