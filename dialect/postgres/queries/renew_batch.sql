{{- /*
renew_batch: renewSQL for many leases in one statement and one commit:
lease ($1[i], $2[i]) to now + $3[i] µs, one "now" for the batch; rows
locked in key order, and a row locked by another transaction skipped (the
client renews it alone) rather than waited for
(docs/postgres-statements.md#batches).
*/ -}}
WITH now AS MATERIALIZED (
    SELECT clock_timestamp() AS now,
           {{template "durable"}} AS durable
), req AS MATERIALIZED (
    SELECT r.key, r.token, r.micros
    FROM unnest($1::text[], $2::bigint[], $3::bigint[]) AS r(key, token, micros)
), lk AS MATERIALIZED (
    SELECT l.key, r.token, r.micros
    FROM {{.Table}} AS l
    JOIN req AS r ON l.key = r.key AND l.token = r.token
    CROSS JOIN now AS n
    WHERE l.held AND l.deadline > n.now
    ORDER BY l.key
    FOR NO KEY UPDATE OF l SKIP LOCKED
), upd AS (
    UPDATE {{.Table}} AS l
    SET deadline = greatest(l.deadline, n.now + k.micros * interval '1 microsecond')
    FROM lk AS k, now AS n
    WHERE l.key = k.key AND l.token = k.token
    RETURNING l.key, l.token, l.deadline
)
SELECT r.key, r.token, u.key IS NOT NULL AS renewed,
       coalesce(u.deadline, c.deadline, n.now), coalesce(c.token, 0), coalesce(c.held, false), n.now
FROM req AS r
CROSS JOIN now AS n
LEFT JOIN upd AS u ON u.key = r.key AND u.token = r.token
LEFT JOIN {{.Table}} AS c ON c.key = r.key AND u.key IS NULL
