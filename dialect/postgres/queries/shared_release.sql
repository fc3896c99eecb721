{{- /*
shared_release: releases reader slot $1 with token $2 ($3 recorded as who
released) iff the slot is held with $2; then, if its key $4 is held
shared by an epoch at or below $2, counts one reader fewer, and the last
one releases $4 at once and notifies $4's waiters (.Notify, when a
waiter marked K). K's row is locked first (kl), the slot's second (su,
whose UPDATE joins kl), each checked again on its newest version: two
releases of one slot (its holder's and a forced one) count one reader
fewer, not two. Each row is read once from the snapshot (s, k: what a
refusal is explained by) and once more to be locked and written.
Commits as release does (docs/shared-locks.md).
*/ -}}
WITH s AS MATERIALIZED (
    SELECT c.key, c.token, c.held, c.deadline, c.owner FROM {{.Table}} AS c WHERE c.key = $1
), k AS MATERIALIZED (
    SELECT c.key, c.token, c.held, c.deadline, c.owner, c.epoch FROM {{.Table}} AS c WHERE c.key = $4
), kl AS (
    SELECT c.key FROM {{.Table}} AS c
    WHERE c.key = $4 AND c.held AND c.owner = '' AND c.epoch <= $2
      AND EXISTS (SELECT FROM s WHERE s.token = $2 AND s.held)
    FOR NO KEY UPDATE OF c
), su AS (
    UPDATE {{.Table}} AS l
    SET held = false, owner = $3
    FROM (SELECT) AS one LEFT JOIN kl ON true
    WHERE l.key = $1 AND l.token = $2 AND l.held
    RETURNING l.deadline > clock_timestamp() AS valid,
{{- if .DurableRelease}}
              {{template "durable"}} AS commit
{{- else}}
              set_config('synchronous_commit', 'off', true) AS commit
{{- end}}
), ku AS (
    UPDATE {{.Table}} AS l
    SET shared = greatest(l.shared - 1, 0), held = l.shared > 1
    FROM kl, su WHERE l.key = kl.key
    RETURNING l.held, l.waited
)
SELECT su.valid IS NOT NULL AS released, coalesce(su.valid, false), ku.held IS NOT NULL AS counted, coalesce(NOT ku.held, false) AS last,
       s.key IS NOT NULL, coalesce(s.token, 0), coalesce(s.held, false), coalesce(s.deadline, statement_timestamp()), coalesce(s.owner, ''),
       k.key IS NOT NULL, coalesce(k.token, 0), coalesce(k.held, false), coalesce(k.deadline, statement_timestamp()),
       coalesce(k.owner, ''), coalesce(k.epoch, 0), statement_timestamp(),
{{- if .Notify}}
       CASE WHEN NOT ku.held AND ku.waited
           THEN num_nonnulls(pg_notify('sqllock.' || '{{.Table}}'::regclass::oid::text, $4))
           ELSE 0 END AS notified
{{- else}}
       0 AS notified
{{- end}}
FROM (SELECT) AS one
LEFT JOIN su ON true
LEFT JOIN ku ON true
LEFT JOIN s ON true
LEFT JOIN k ON true
