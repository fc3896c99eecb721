{{- /*
shared_renew: renews reader slot ?1 with token ?2 to now + ?3 ms, and moves
its key ?4's deadline to at least that, iff the slot is held with ?2,
unexpired, and ?4 is held shared, unexpired, by an epoch at or below ?2;
otherwise writes both rows to themselves. Returns both rows: the caller
tells the outcome, and why a lease is lost (docs/shared-locks.md).
*/ -}}
WITH v AS (SELECT
	coalesce((SELECT s.held AND s.deadline > {{.Now}} AND s.token = ?2 FROM {{.Table}} AS s WHERE s.key = ?1), 0)
	AND coalesce((SELECT k.held AND k.owner = '' AND k.deadline > {{.Now}} AND k.epoch <= ?2 FROM {{.Table}} AS k WHERE k.key = ?4), 0) AS ok)
INSERT INTO {{.Table}} (key, token, held, deadline, owner)
SELECT t.key, t.token, t.held,
	CASE WHEN NOT v.ok THEN t.deadline WHEN t.key = ?1 THEN {{.Now}} + ?3 ELSE max(t.deadline, {{.Now}} + ?3) END,
	t.owner
FROM {{.Table}} AS t, v WHERE t.key IN (?1, ?4)
ON CONFLICT (key) DO UPDATE SET deadline = excluded.deadline
RETURNING key, token, held, deadline, owner, epoch, {{.Now}}
