{{- /*
acquire_all_batch: acquire_all for many sets in one statement and one
commit (group commit of sets). Set i (1-based) is owner $4[i], $3[i] µs,
value $5[i]; its keys are the $1[j] with $2[j] = i. No key is in two sets
of a batch (the Go side's queue keeps that). Each set keeps acquire_all's
rules on its own: its rows as the snapshot saw them, read by their own
key; only when every one may be granted are they locked, in key order
across the batch and SKIP LOCKED (a row another transaction holds locked
refuses its set, never waited for), and only a set whose rows were all
locked is granted, its fresh keys inserted in key order across the batch
(the only wait: a fresh key another transaction is inserting, which
fails the whole statement with a unique violation, 23505; every set is
then sent alone). A set refused in the snapshot locks no row and writes
nothing. The grant of locked rows is an INSERT ... ON CONFLICT DO UPDATE,
as in acquire_all, with the set's owner, value and deadline (now + TTL)
in the excluded row; its insert half never happens (each row of lk
exists and is locked by this statement; were it to, token 1 is refused
by the floor trigger). Sent only on a table at the latest version.
*/ -}}
WITH now AS MATERIALIZED (
    SELECT statement_timestamp() AS now
), sets AS MATERIALIZED (
    SELECT s.ord, s.micros, s.owner, s.value
    FROM unnest((SELECT $3::bigint[]), (SELECT $4::text[]), (SELECT $5::bytea[])) WITH ORDINALITY AS s(micros, owner, value, ord)
), req AS MATERIALIZED (
    SELECT k.key, k.ord
    FROM unnest((SELECT $1::text[]), (SELECT $2::bigint[])) AS k(key, ord)
), seen AS MATERIALIZED (
    SELECT r.ord, l.key, l.token, l.held, l.deadline, l.owner, l.value, l.hold_until, l.shared,
           (l.held AND l.deadline > n.now AND l.owner = s.owner)
           OR (((NOT l.held AND coalesce(l.hold_until <= n.now, true)) OR l.deadline <= n.now) AND l.token < 9223372036854775807) AS grantable
    FROM req AS r
    JOIN sets AS s ON s.ord = r.ord
    CROSS JOIN now AS n
    CROSS JOIN LATERAL (
        SELECT c.* FROM {{.Table}} AS c WHERE c.key = r.key OFFSET 0
    ) AS l
), verdict AS MATERIALIZED (
    SELECT s.ord, NOT EXISTS (SELECT FROM seen AS x WHERE x.ord = s.ord AND NOT x.grantable) AS ok
    FROM sets AS s
), lk AS MATERIALIZED (
    SELECT l.key, x.ord
    FROM (SELECT x.key, x.ord, s.owner
          FROM seen AS x
          JOIN verdict AS v ON v.ord = x.ord AND v.ok
          JOIN sets AS s ON s.ord = x.ord
          ORDER BY x.key) AS x
    CROSS JOIN now AS n
    CROSS JOIN LATERAL (
        SELECT c.key FROM {{.Table}} AS c
        WHERE c.key = x.key
          AND ((c.held AND c.deadline > n.now AND c.owner = x.owner)
               OR (((NOT c.held AND coalesce(c.hold_until <= n.now, true)) OR c.deadline <= n.now) AND c.token < 9223372036854775807))
        FOR NO KEY UPDATE OF c SKIP LOCKED
    ) AS l
), decided AS MATERIALIZED (
    SELECT v.ord,
           v.ok AND (SELECT count(*) FROM lk AS k WHERE k.ord = v.ord) = (SELECT count(*) FROM seen AS x WHERE x.ord = v.ord) AS ok
    FROM verdict AS v
), upd AS (
    INSERT INTO {{.Table}} AS l (key, token, held, deadline, owner, value, hold_until)
    SELECT k.key, 1, true, n.now + s.micros * interval '1 microsecond', s.owner, s.value, NULL
    FROM lk AS k
    JOIN decided AS d ON d.ord = k.ord AND d.ok
    JOIN sets AS s ON s.ord = k.ord
    CROSS JOIN now AS n
    ORDER BY k.key
    ON CONFLICT (key) DO UPDATE
    SET token = CASE WHEN l.held AND l.deadline > (SELECT n.now FROM now AS n) THEN l.token ELSE l.token + 1 END,
        held = true,
        deadline = CASE WHEN l.held AND l.deadline > (SELECT n.now FROM now AS n)
                        THEN greatest(l.deadline, excluded.deadline)
                        ELSE excluded.deadline END,
        owner = excluded.owner,
        waited = l.waited AND l.held AND l.deadline > (SELECT n.now FROM now AS n),
        value = excluded.value,
        hold_until = CASE WHEN l.held AND l.deadline > (SELECT n.now FROM now AS n) THEN l.hold_until END
    RETURNING l.key, l.token, l.deadline, {{template "durable"}} AS durable
), ins AS (
    INSERT INTO {{.Table}} AS l (key, token, held, deadline, owner, value, hold_until)
    SELECT r.key, (SELECT f.last_value + 1 FROM {{.Floor}} AS f), true, n.now + s.micros * interval '1 microsecond', s.owner, s.value, NULL
    FROM req AS r
    JOIN decided AS d ON d.ord = r.ord AND d.ok
    JOIN sets AS s ON s.ord = r.ord
    CROSS JOIN now AS n
    WHERE NOT EXISTS (SELECT FROM seen AS x WHERE x.key = r.key)
    ORDER BY r.key
    RETURNING l.key, l.token, l.deadline, {{template "durable"}} AS durable
)
SELECT r.ord,
       r.key,
       u.key IS NOT NULL OR i.key IS NOT NULL AS granted,
       coalesce(u.token, i.token, x.token, 0),
       coalesce(u.deadline, i.deadline, x.deadline, n.now),
       coalesce(x.held OR x.hold_until > n.now, x.held, false),
       coalesce(x.owner, ''),
       n.now,
       coalesce(x.grantable, true) AS grantable,
       x.key IS NOT NULL AND k.key IS NULL AS unlocked,
       x.value,
       CASE WHEN x.held AND x.owner = '' AND x.deadline > n.now THEN x.shared ELSE 0 END AS shared
FROM req AS r
CROSS JOIN now AS n
LEFT JOIN upd AS u ON u.key = r.key
LEFT JOIN ins AS i ON i.key = r.key
LEFT JOIN seen AS x ON x.key = r.key
LEFT JOIN lk AS k ON k.key = r.key
