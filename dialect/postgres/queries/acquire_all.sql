{{- /*
acquire_all: grants every key of the JSON array $1 (sorted) to owner $3 for
$2 µs (value $4), or none, in one statement; no min hold. seen is the set's
rows in the statement's snapshot, read without a lock, with acquire's grant
rule per row; only when every one may be granted are they locked, in key
order and SKIP LOCKED (a row another transaction holds locked counts as a
refusal, never waited for), and only when every one was locked, rechecked
on its newest version, are they updated and the fresh keys inserted, in key
order. A fresh key inserted meanwhile by another transaction fails the
statement with a unique violation (23505): rolled back whole. A refusal
seen in the snapshot locks no row and writes nothing
(docs/multi-key.md#postgresql). The rows are found by key = ANY of an
array, an index scan (a join with the key list would scan the table: the
planner takes the JSON array for 100 rows). Sent only on a table at
version 5.
*/ -}}
WITH now AS MATERIALIZED (
    SELECT statement_timestamp() AS now
), req AS MATERIALIZED (
    SELECT k.key FROM jsonb_array_elements_text($1::jsonb) AS k(key)
), seen AS MATERIALIZED (
    SELECT l.key, l.token, l.held, l.deadline, l.owner, l.value, l.hold_until,
           (l.held AND l.deadline > n.now AND l.owner = $3)
           OR (((NOT l.held AND coalesce(l.hold_until <= n.now, true)) OR l.deadline <= n.now) AND l.token < 9223372036854775807) AS grantable
    FROM {{.Table}} AS l
    CROSS JOIN now AS n
    WHERE l.key = ANY (ARRAY(SELECT r.key FROM req AS r))
), verdict AS MATERIALIZED (
    SELECT NOT EXISTS (SELECT FROM seen AS s WHERE NOT s.grantable) AS ok
), lk AS MATERIALIZED (
    SELECT l.key
    FROM {{.Table}} AS l
    CROSS JOIN now AS n
    WHERE (SELECT v.ok FROM verdict AS v)
      AND l.key = ANY (ARRAY(SELECT s.key FROM seen AS s))
      AND ((l.held AND l.deadline > n.now AND l.owner = $3)
           OR (((NOT l.held AND coalesce(l.hold_until <= n.now, true)) OR l.deadline <= n.now) AND l.token < 9223372036854775807))
    ORDER BY l.key
    FOR NO KEY UPDATE OF l SKIP LOCKED
), decided AS MATERIALIZED (
    SELECT (SELECT v.ok FROM verdict AS v) AND (SELECT count(*) FROM lk) = (SELECT count(*) FROM seen) AS ok
), upd AS (
    UPDATE {{.Table}} AS l
    SET token = CASE WHEN l.held AND l.deadline > n.now THEN l.token ELSE l.token + 1 END,
        held = true,
        deadline = CASE WHEN l.held AND l.deadline > n.now
                        THEN greatest(l.deadline, n.now + $2::bigint * interval '1 microsecond')
                        ELSE n.now + $2::bigint * interval '1 microsecond' END,
        owner = $3,
        waited = l.waited AND l.held AND l.deadline > n.now,
        value = $4::bytea,
        hold_until = CASE WHEN l.held AND l.deadline > n.now THEN l.hold_until END
    FROM now AS n
    WHERE l.key = ANY (ARRAY(SELECT k.key FROM lk AS k)) AND (SELECT d.ok FROM decided AS d)
    RETURNING l.key, l.token, l.deadline, {{template "durable"}} AS durable
), ins AS (
    INSERT INTO {{.Table}} AS l (key, token, held, deadline, owner, value, hold_until)
    SELECT r.key, {{if ge .Version 6}}(SELECT f.last_value + 1 FROM {{.Floor}} AS f){{else}}1{{end}}, true, n.now + $2::bigint * interval '1 microsecond', $3, $4::bytea, NULL
    FROM req AS r CROSS JOIN now AS n
    WHERE (SELECT d.ok FROM decided AS d) AND NOT EXISTS (SELECT FROM seen AS s WHERE s.key = r.key)
    ORDER BY r.key
    RETURNING l.key, l.token, l.deadline, {{template "durable"}} AS durable
)
SELECT r.key,
       u.key IS NOT NULL OR i.key IS NOT NULL AS granted,
       coalesce(u.token, i.token, s.token, 0),
       coalesce(u.deadline, i.deadline, s.deadline, n.now),
       coalesce(s.held OR s.hold_until > n.now, s.held, false),
       coalesce(s.owner, ''),
       n.now,
       coalesce(s.grantable, true) AS grantable,
       s.key IS NOT NULL AND k.key IS NULL AS unlocked,
       s.value
FROM req AS r
CROSS JOIN now AS n
LEFT JOIN upd AS u ON u.key = r.key
LEFT JOIN ins AS i ON i.key = r.key
LEFT JOIN seen AS s ON s.key = r.key
LEFT JOIN lk AS k ON k.key = r.key
