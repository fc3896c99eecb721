{{- /*
shared_release: releases reader slot ?1 with token ?2 (?3 recorded as who
released) iff the slot is held with ?2; then, if its key ?4 is held shared
by an epoch at or below ?2, counts one reader fewer, and the last one
releases ?4 at once. Writes both rows (unchanged when nothing applies) and
returns them (docs/shared-locks.md).
*/ -}}
WITH v AS (SELECT
	coalesce((SELECT s.held AND s.token = ?2 FROM {{.Table}} AS s WHERE s.key = ?1), 0) AS rel,
	coalesce((SELECT k.held AND k.owner = '' AND k.epoch <= ?2 FROM {{.Table}} AS k WHERE k.key = ?4), 0) AS dec)
INSERT INTO {{.Table}} (key, token, held, deadline, owner, shared)
SELECT t.key, t.token,
	CASE WHEN NOT v.rel THEN t.held WHEN t.key = ?1 THEN 0 WHEN v.dec AND t.shared <= 1 THEN 0 ELSE t.held END,
	t.deadline,
	CASE WHEN v.rel AND t.key = ?1 THEN ?3 ELSE t.owner END,
	CASE WHEN v.rel AND v.dec AND t.key = ?4 THEN max(t.shared - 1, 0) ELSE t.shared END
FROM {{.Table}} AS t, v WHERE t.key IN (?1, ?4)
ON CONFLICT (key) DO UPDATE SET held = excluded.held, owner = excluded.owner, shared = excluded.shared
RETURNING key, token, held, deadline, owner, shared, epoch, {{.Now}}
