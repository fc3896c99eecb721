{{- /*
permit_create: semaphore ?1's limit row (its token is the limit ?2, never
held) and its ?2 permits, free with token 1, iff the semaphore has no
limit row yet: all of them or none.
*/ -}}
WITH RECURSIVE p(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM p WHERE i < ?2)
INSERT INTO {{.Table}} (key, token, held, deadline, owner)
SELECT ?1 || '#permits', ?2, 0, {{.Now}}, ''
WHERE NOT EXISTS (SELECT 1 FROM {{.Table}} WHERE key = ?1 || '#permits')
UNION ALL
SELECT ?1 || '#permit-' || i, 1, 0, {{.Now}}, '' FROM p
WHERE NOT EXISTS (SELECT 1 FROM {{.Table}} WHERE key = ?1 || '#permits')
ON CONFLICT DO NOTHING
