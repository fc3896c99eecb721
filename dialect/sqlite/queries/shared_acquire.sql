{{- /*
shared_acquire: grants key ?1 shared to owner ?3 for ?2 ms (value ?4) in
one statement: it computes, from the rows as they were, K's row and the
reader slot's row (?1 || '#shared-' || i) and writes both (a refusal writes
K's row to itself and no slot). The slot is the one ?3 holds already (a
retry), else the lowest free one (released, expired, or of an earlier
epoch), else a new one. A key without a row (new, or reaped) starts at
the floor of reaped keys, as an exclusive grant does. Refused while K is held exclusive (or inside its
min hold), while a writer's mark is live, with every slot taken, or at the
end of the tokens. INSERT ... SELECT reading its own table runs the SELECT
to completion first (docs/shared-locks.md).
*/ -}}
WITH RECURSIVE
k AS (
	SELECT coalesce(t.token, (SELECT floor FROM {{.Floor}})) AS token, coalesce(t.held, 0) AS held, coalesce(t.deadline, 0) AS deadline,
		coalesce(t.owner, '') AS owner, t.value AS value, t.hold_until AS hold_until,
		coalesce(t.shared, 0) AS shared, coalesce(t.epoch, 0) AS epoch, coalesce(t.slots, 0) AS slots,
		t.mark_owner AS mark_owner, t.mark_deadline AS mark_deadline,
		coalesce(t.held AND t.owner = '' AND t.deadline > {{.Now}}, 0) AS live
	FROM (SELECT 1) LEFT JOIN {{.Table}} AS t ON t.key = ?1),
p(i) AS (SELECT 1 UNION ALL SELECT p.i + 1 FROM p, k WHERE p.i < k.slots),
c AS (
	SELECT p.i AS i, s.token AS token, s.value AS value,
		(k.live AND s.held AND s.deadline > {{.Now}} AND s.owner = ?3 AND s.token >= k.epoch) AS retry,
		(k.live AND s.held AND s.token >= k.epoch) AS counted
	FROM p, k JOIN {{.Table}} AS s ON s.key = ?1 || '#shared-' || p.i
	WHERE (k.live AND s.held AND s.deadline > {{.Now}} AND s.owner = ?3 AND s.token >= k.epoch)
		OR NOT k.live OR NOT s.held OR s.deadline <= {{.Now}} OR s.token < k.epoch),
pick AS (
	SELECT i, token, value, retry, counted FROM c
	UNION ALL SELECT k.slots + 1, 0, NULL, 0, 0 FROM k WHERE k.slots < 1024
	ORDER BY retry DESC, i LIMIT 1),
g AS (
	SELECT k.*, pick.i AS i, pick.token AS stoken, pick.value AS svalue, pick.counted AS counted,
		CASE
			WHEN pick.retry THEN 1
			WHEN NOT k.live AND ((k.held AND k.deadline > {{.Now}})
				OR (NOT k.held AND coalesce(k.hold_until, 0) > {{.Now}} AND k.deadline > {{.Now}})) THEN 0
			WHEN k.mark_owner IS NOT NULL AND k.mark_deadline > {{.Now}} THEN 0
			WHEN pick.i IS NULL THEN 0
			WHEN max(k.token, pick.token) >= 9223372036854775807 THEN 0
			ELSE 2 END AS act,
		CASE WHEN max(k.token, coalesce(pick.token, 0)) < 9223372036854775807 THEN max(k.token, coalesce(pick.token, 0)) + 1 END AS t
	FROM k LEFT JOIN pick)
INSERT INTO {{.Table}} (key, token, held, deadline, owner, value, hold_until, shared, epoch, slots, mark_owner, mark_deadline)
SELECT ?1,
	CASE act WHEN 2 THEN t ELSE token END,
	CASE act WHEN 0 THEN held ELSE 1 END,
	CASE WHEN act = 0 THEN deadline WHEN live THEN max(deadline, {{.Now}} + ?2) ELSE {{.Now}} + ?2 END,
	CASE act WHEN 0 THEN owner ELSE '' END,
	CASE act WHEN 0 THEN value END,
	CASE act WHEN 0 THEN hold_until END,
	CASE WHEN act <> 2 THEN shared WHEN NOT live THEN 1 WHEN counted THEN shared ELSE shared + 1 END,
	CASE WHEN act = 2 AND NOT live THEN t ELSE epoch END,
	CASE act WHEN 2 THEN max(slots, i) ELSE slots END,
	mark_owner, mark_deadline
FROM g
UNION ALL
SELECT ?1 || '#shared-' || i, CASE act WHEN 1 THEN stoken ELSE t END, 1, {{.Now}} + ?2, ?3,
	CASE act WHEN 1 THEN svalue ELSE ?4 END, NULL, 0, 0, 0, NULL, NULL
FROM g WHERE act > 0
ON CONFLICT (key) DO UPDATE SET
	token = excluded.token, held = excluded.held, deadline = excluded.deadline, owner = excluded.owner,
	value = excluded.value, hold_until = excluded.hold_until, shared = excluded.shared, epoch = excluded.epoch,
	slots = excluded.slots, mark_owner = excluded.mark_owner, mark_deadline = excluded.mark_deadline
RETURNING key, token, held, deadline, owner, value, coalesce(hold_until, 0), shared, coalesce(mark_owner, ''), coalesce(mark_deadline, 0), {{.Now}}
