{{- /*
release_batch: release for many leases in one statement and one commit,
with release's rules per lease at the batch's one "now"; rows locked in key
order, SKIP LOCKED: a lease whose row is locked comes back unreleased and
is released again alone. Each row is found by its own key, as in
acquire_all.sql: a LATERAL lookup to lock it and to read a lease's row that
was not released, and the release is an INSERT ... ON CONFLICT DO UPDATE
whose insert half never happens (excluded.deadline is now), so that no
plan of it scans the table. Sent only on a table at version 5
(docs/postgres-statements.md#batches).
*/ -}}
WITH now AS MATERIALIZED (
    SELECT clock_timestamp() AS now
), req AS MATERIALIZED (
    SELECT r.key, r.token, r.owner
    FROM unnest((SELECT $1::text[]), (SELECT $2::bigint[]), (SELECT $3::text[])) AS r(key, token, owner)
), lk AS MATERIALIZED (
    SELECT l.key, r.token, r.owner
    FROM (SELECT r.key, r.token, r.owner FROM req AS r ORDER BY r.key) AS r
    CROSS JOIN LATERAL (
        SELECT c.key FROM {{.Table}} AS c
        WHERE c.key = r.key AND c.token = r.token AND c.held
        FOR NO KEY UPDATE OF c SKIP LOCKED
    ) AS l
), upd AS (
    INSERT INTO {{.Table}} AS l (key, token, held, deadline, owner)
    SELECT k.key, k.token, false, n.now, k.owner
    FROM lk AS k CROSS JOIN now AS n
    ORDER BY k.key
    ON CONFLICT (key) DO UPDATE
    SET held = false, owner = excluded.owner,
        deadline = CASE WHEN l.owner = excluded.owner AND l.hold_until > excluded.deadline AND l.deadline > excluded.deadline THEN l.hold_until ELSE l.deadline END,
        hold_until = CASE WHEN l.owner = excluded.owner THEN l.hold_until END
    WHERE l.token = excluded.token AND l.held
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
LEFT JOIN LATERAL (
    SELECT c.token, c.held, c.deadline, c.owner
    FROM {{.Table}} AS c
    WHERE c.key = r.key AND u.key IS NULL
    OFFSET 0
) AS c ON true
