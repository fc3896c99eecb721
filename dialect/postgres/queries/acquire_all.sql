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
(docs/multi-key.md#postgresql). Each row is found, and locked, by its own
key (a LATERAL lookup that OFFSET 0 or its lock keeps from becoming a
join), and the grant of the locked rows is an INSERT ... ON CONFLICT DO
UPDATE, which finds each row by the key's index: no step can be planned
as a scan of the table, also in the generic plan a connection keeps for
the statement, made once on the table as it then was (a join with the key
list, or key = ANY (array), is planned as a scan on a young or small
table, and stays one as it grows). The insert half of upd never happens
(each row of lk exists and is locked by this statement; were it to, token
1 is refused by the floor trigger). excluded.deadline is now. Sent from
version 5 on; from 00007 a key held by readers (no owner) refuses the set
with the readers' count, as acquire's refusal does.
*/ -}}
WITH now AS MATERIALIZED (
    SELECT statement_timestamp() AS now
), req AS MATERIALIZED (
    SELECT k.key FROM jsonb_array_elements_text($1::jsonb) AS k(key)
), seen AS MATERIALIZED (
    SELECT l.key, l.token, l.held, l.deadline, l.owner, l.value, l.hold_until,{{if ge .Version 7}} l.shared,{{end}}
           (l.held AND l.deadline > n.now AND l.owner = $3)
           OR (((NOT l.held AND coalesce(l.hold_until <= n.now, true)) OR l.deadline <= n.now) AND l.token < 9223372036854775807) AS grantable
    FROM req AS r
    CROSS JOIN now AS n
    CROSS JOIN LATERAL (
        SELECT c.* FROM {{.Table}} AS c WHERE c.key = r.key OFFSET 0
    ) AS l
), verdict AS MATERIALIZED (
    SELECT NOT EXISTS (SELECT FROM seen AS s WHERE NOT s.grantable) AS ok
), lk AS MATERIALIZED (
    SELECT l.key
    FROM (SELECT s.key FROM seen AS s ORDER BY s.key) AS s
    CROSS JOIN now AS n
    CROSS JOIN LATERAL (
        SELECT c.key FROM {{.Table}} AS c
        WHERE (SELECT v.ok FROM verdict AS v)
          AND c.key = s.key
          AND ((c.held AND c.deadline > n.now AND c.owner = $3)
               OR (((NOT c.held AND coalesce(c.hold_until <= n.now, true)) OR c.deadline <= n.now) AND c.token < 9223372036854775807))
        FOR NO KEY UPDATE OF c SKIP LOCKED
    ) AS l
), decided AS MATERIALIZED (
    SELECT (SELECT v.ok FROM verdict AS v) AND (SELECT count(*) FROM lk) = (SELECT count(*) FROM seen) AS ok
), upd AS (
    INSERT INTO {{.Table}} AS l (key, token, held, deadline, owner, value, hold_until)
    SELECT k.key, 1, true, n.now, $3, $4::bytea, NULL
    FROM lk AS k CROSS JOIN now AS n
    WHERE (SELECT d.ok FROM decided AS d)
    ORDER BY k.key
    ON CONFLICT (key) DO UPDATE
    SET token = CASE WHEN l.held AND l.deadline > excluded.deadline THEN l.token ELSE l.token + 1 END,
        held = true,
        deadline = CASE WHEN l.held AND l.deadline > excluded.deadline
                        THEN greatest(l.deadline, excluded.deadline + $2::bigint * interval '1 microsecond')
                        ELSE excluded.deadline + $2::bigint * interval '1 microsecond' END,
        owner = $3,
        waited = l.waited AND l.held AND l.deadline > excluded.deadline,
        value = $4::bytea,
        hold_until = CASE WHEN l.held AND l.deadline > excluded.deadline THEN l.hold_until END
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
       s.value,
{{- if ge .Version 7}}
       CASE WHEN s.held AND s.owner = '' AND s.deadline > n.now THEN s.shared ELSE 0 END AS shared
{{- else}}
       0 AS shared
{{- end}}
FROM req AS r
CROSS JOIN now AS n
LEFT JOIN upd AS u ON u.key = r.key
LEFT JOIN ins AS i ON i.key = r.key
LEFT JOIN seen AS s ON s.key = r.key
LEFT JOIN lk AS k ON k.key = r.key
