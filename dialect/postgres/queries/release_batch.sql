{{- /*
release_batch: release for many leases in one statement and one commit,
with release's rules per lease at the batch's one "now"; rows locked in key
order, SKIP LOCKED: a lease whose row is locked comes back unreleased and
is released again alone. Sent only on a table at version 5
(docs/postgres-statements.md#batches).
*/ -}}
WITH now AS MATERIALIZED (
    SELECT clock_timestamp() AS now
), req AS MATERIALIZED (
    SELECT r.key, r.token, r.owner
    FROM unnest((SELECT $1::text[]), (SELECT $2::bigint[]), (SELECT $3::text[])) AS r(key, token, owner)
), lk AS MATERIALIZED (
    SELECT l.key, r.token, r.owner
    FROM {{.Table}} AS l
    JOIN req AS r ON l.key = r.key AND l.token = r.token
    WHERE l.held
    ORDER BY l.key
    FOR NO KEY UPDATE OF l SKIP LOCKED
), upd AS (
    UPDATE {{.Table}} AS l
    SET held = false, owner = k.owner,
        deadline = CASE WHEN l.owner = k.owner AND l.hold_until > n.now AND l.deadline > n.now THEN l.hold_until ELSE l.deadline END,
        hold_until = CASE WHEN l.owner = k.owner THEN l.hold_until END
    FROM lk AS k, now AS n
    WHERE l.key = k.key AND l.token = k.token AND l.held
    RETURNING l.key, l.deadline, l.waited AS waited,
{{- if .DurableRelease}}
              {{template "durable"}} AS commit
{{- else}}
              set_config('synchronous_commit', 'off', true) AS commit
{{- end}}
)
SELECT r.key, u.key IS NOT NULL AS released, coalesce(u.deadline > n.now, false) AS valid,
       coalesce(c.token, 0), coalesce(c.held, false), coalesce(c.deadline, n.now),
       coalesce(c.owner, ''), n.now,
{{- if .Notify}}
       CASE WHEN u.waited
           THEN num_nonnulls(pg_notify('sqllock.' || '{{.Table}}'::regclass::oid::text, u.key))
           ELSE 0 END AS notified
{{- else}}
       0 AS notified
{{- end}}
FROM req AS r
CROSS JOIN now AS n
LEFT JOIN upd AS u ON u.key = r.key
LEFT JOIN {{.Table}} AS c ON c.key = r.key AND u.key IS NULL
