{{- /*
renew_batch: renew for many leases in one statement, at one instant ?2
(ms, read by now.sql in the same write transaction): ?1 is a JSON array of
[key, token, ttl ms], so the text and its two parameters are the same for
every batch size. A deadline never moves back; each row is returned with
its key (docs/sqlite-statements.md#batch-renewal).
*/ -}}
UPDATE {{.Table}} AS l SET deadline = CASE
	WHEN l.token = r.token AND l.held AND l.deadline > ?2 THEN max(l.deadline, ?2 + r.ms)
	ELSE l.deadline END
FROM (SELECT j.value ->> 0 AS key, j.value ->> 1 AS token, j.value ->> 2 AS ms FROM json_each(?1) AS j) AS r
WHERE l.key = r.key
RETURNING key, token, held, deadline
