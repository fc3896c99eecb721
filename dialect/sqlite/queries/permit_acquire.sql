{{- /*
permit_acquire: grants one permit of semaphore ?1 (limit ?5) to owner ?3
for ?2 ms (value ?4): the permit ?3 holds already (a retry after a lost
reply keeps its token and extends its deadline), else the lowest free one
(released or expired, token below the largest int64), iff the semaphore's
limit row says ?5. A refusal matches no row and writes nothing; the
caller then reads the semaphore (permit_peek) to say why
(docs/semaphores.md).
*/ -}}
WITH RECURSIVE p(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM p WHERE i < ?5)
UPDATE {{.Table}} SET
	token      = CASE WHEN held AND deadline > {{.Now}} AND owner = ?3 THEN token ELSE token + 1 END,
	value      = CASE WHEN held AND deadline > {{.Now}} AND owner = ?3 THEN value ELSE ?4 END,
	held       = 1,
	deadline   = {{.Now}} + ?2,
	owner      = ?3,
	hold_until = NULL
WHERE key = (
	SELECT c.key FROM p JOIN {{.Table}} AS c ON c.key = ?1 || '#permit-' || p.i
	WHERE (c.held AND c.deadline > {{.Now}} AND c.owner = ?3)
	   OR ((NOT c.held OR c.deadline <= {{.Now}}) AND c.token < 9223372036854775807)
	ORDER BY c.held AND c.deadline > {{.Now}} AND c.owner = ?3 DESC, p.i
	LIMIT 1)
  AND EXISTS (SELECT 1 FROM {{.Table}} WHERE key = ?1 || '#permits' AND token = ?5)
RETURNING key, token, deadline, value, {{.Now}}
