{{- /*
acquire_batch: acquire for many keys in one statement and one commit (group
commit), with every per-key rule of acquire at the batch's one "now"; the
plain form only (a waiting acquire is always sent alone). Rows locked in key
order, SKIP LOCKED: a row grantable but locked comes back "skipped" and is
sent again alone. A key's first row takes the floor of reaped keys + 1,
as acquire's. Sent only on a table at the latest version
(docs/postgres-statements.md#batches).
*/ -}}
WITH now AS MATERIALIZED (
    SELECT clock_timestamp() AS now,
           {{template "durable"}} AS durable
), req AS MATERIALIZED (
    SELECT r.key, r.micros, r.owner, r.value, r.hold
    FROM unnest((SELECT $1::text[]), (SELECT $2::bigint[]), (SELECT $3::text[]), (SELECT $4::bytea[]), (SELECT $5::bigint[]))
         AS r(key, micros, owner, value, hold)
), lk AS MATERIALIZED (
    SELECT l.key, r.micros, r.owner, r.value, r.hold
    FROM {{.Table}} AS l
    JOIN req AS r ON l.key = r.key
    CROSS JOIN now AS n
    WHERE (l.held AND l.deadline > n.now AND l.owner = r.owner)
       OR (((NOT l.held AND coalesce(l.hold_until <= n.now, true)) OR l.deadline <= n.now) AND l.token < 9223372036854775807)
    ORDER BY l.key
    FOR NO KEY UPDATE OF l SKIP LOCKED
), upd AS (
    UPDATE {{.Table}} AS l
    SET token = CASE WHEN l.held AND l.deadline > n.now THEN l.token ELSE l.token + 1 END,
        held = true,
        deadline = CASE WHEN l.held AND l.deadline > n.now
                        THEN greatest(l.deadline, n.now + k.micros * interval '1 microsecond')
                        ELSE n.now + greatest(k.micros, k.hold) * interval '1 microsecond' END,
        owner = k.owner,
        waited = l.waited AND l.held AND l.deadline > n.now,
        value = k.value,
        hold_until = CASE WHEN l.held AND l.deadline > n.now THEN l.hold_until
                          WHEN k.hold > 0 THEN n.now + k.hold * interval '1 microsecond' END
    FROM lk AS k, now AS n
    WHERE l.key = k.key
      AND ((l.held AND l.deadline > n.now AND l.owner = k.owner)
           OR (((NOT l.held AND coalesce(l.hold_until <= n.now, true)) OR l.deadline <= n.now) AND l.token < 9223372036854775807))
    RETURNING l.key, l.token, l.deadline
), ins AS (
    INSERT INTO {{.Table}} AS l (key, token, held, deadline, owner, value, hold_until)
    SELECT r.key, (SELECT f.last_value + 1 FROM {{.Floor}} AS f), true, n.now + greatest(r.micros, r.hold) * interval '1 microsecond', r.owner, r.value,
           CASE WHEN r.hold > 0 THEN n.now + r.hold * interval '1 microsecond' END
    FROM req AS r CROSS JOIN now AS n
    WHERE NOT EXISTS (SELECT FROM {{.Table}} AS c WHERE c.key = r.key)
    ORDER BY r.key
    ON CONFLICT (key) DO UPDATE
    SET deadline = greatest(l.deadline, excluded.deadline)
    WHERE l.held AND l.owner = excluded.owner AND l.deadline > (SELECT n.now FROM now AS n)
    RETURNING l.key, l.token, l.deadline
)
SELECT r.key,
       u.key IS NOT NULL OR i.key IS NOT NULL AS granted,
       coalesce(u.token, i.token, c.token, 0),
       coalesce(u.deadline, i.deadline, c.deadline, n.now),
       coalesce(c.held OR c.hold_until > n.now, c.held, u.key IS NOT NULL OR i.key IS NOT NULL),
       coalesce(c.owner, ''),
       n.now,
       coalesce((c.held AND c.deadline > n.now AND c.owner = r.owner)
                OR (((NOT c.held AND coalesce(c.hold_until <= n.now, true)) OR c.deadline <= n.now) AND c.token < 9223372036854775807), false) AS skipped,
       c.value,
       CASE WHEN c.held AND c.owner = '' AND c.deadline > n.now THEN c.shared ELSE 0 END AS shared,
       coalesce(CASE WHEN c.mark_deadline > n.now THEN c.mark_owner END, '') AS waiting
FROM req AS r
CROSS JOIN now AS n
LEFT JOIN upd AS u ON u.key = r.key
LEFT JOIN ins AS i ON i.key = r.key
LEFT JOIN {{.Table}} AS c ON c.key = r.key AND u.key IS NULL AND i.key IS NULL
