{{- /*
permit_peek: semaphore ?1's limit row and its permits 1 to ?2, after a
permit_acquire that granted nothing: whether the semaphore exists, its
limit, and the holders.
*/ -}}
WITH RECURSIVE p(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM p WHERE i < ?2)
SELECT key, token, held, deadline, owner, value, {{.Now}} FROM {{.Table}}
WHERE key = ?1 || '#permits' OR key IN (SELECT ?1 || '#permit-' || i FROM p)
