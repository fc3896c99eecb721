{{- /*
fence: starts a fenced transaction: locks lease ($1, $2) FOR SHARE iff it
is held and unexpired, so that no acquire can grant the key until the
transaction ends, and reports the row to explain a miss.
*/ -}}
WITH now AS MATERIALIZED (
    SELECT clock_timestamp() AS now
), locked AS MATERIALIZED (
    SELECT l.deadline FROM {{.Table}} AS l, now AS n
    WHERE l.key = $1 AND l.token = $2 AND l.held AND l.deadline > n.now
    FOR SHARE OF l
), cur AS MATERIALIZED (
    SELECT token, held, deadline FROM {{.Table}} WHERE key = $1
)
SELECT k.deadline IS NOT NULL AS locked,
       coalesce(c.token, 0) AS token,
       coalesce(c.held, false) AS held,
       coalesce(c.deadline, n.now) AS deadline,
       n.now
FROM now AS n
LEFT JOIN locked AS k ON true
LEFT JOIN cur AS c ON true
