{{- /*
renew: extends lease ($1, $2) to now + $3 µs iff it is held and unexpired,
never moving its deadline back, and reports the row as the snapshot saw it
to explain a miss (docs/postgres-statements.md#renew).
*/ -}}
WITH upd AS (
    UPDATE {{.Table}} AS l
    SET deadline = greatest(l.deadline, statement_timestamp() + $3::bigint * interval '1 microsecond')
    WHERE l.key = $1 AND l.token = $2 AND l.held AND l.deadline > statement_timestamp()
    RETURNING l.deadline, {{template "durable"}} AS durable
)
SELECT u.deadline IS NOT NULL AS renewed, coalesce(u.deadline, c.deadline) AS deadline, c.token, c.held,
       statement_timestamp() AS now
FROM {{.Table}} AS c LEFT JOIN upd AS u ON true
WHERE c.key = $1
