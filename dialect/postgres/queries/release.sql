{{- /*
release: clears held on lease ($1, $2) iff its token is current, records $3
as the owner who released it, and says whether the lease was still valid
when released. It commits asynchronously unless .DurableRelease, and
notifies (.Notify) only a release that a waiter marked; from 00005 the
holder's own release inside its min hold keeps the key taken until
hold_until (docs/postgres-statements.md#release).
*/ -}}
WITH upd AS (
    UPDATE {{.Table}} AS l
    SET held = false, owner = $3
{{- if ge .Version 5}},
        deadline = CASE WHEN l.owner = $3 AND l.hold_until > statement_timestamp() AND l.deadline > statement_timestamp()
                        THEN l.hold_until ELSE l.deadline END,
        hold_until = CASE WHEN l.owner = $3 THEN l.hold_until END
{{- end}}
    WHERE l.key = $1 AND l.token = $2 AND l.held
    RETURNING l.deadline > clock_timestamp() AS valid, {{if ge .Version 3}}l.waited{{else}}true{{end}} AS waited,
{{- if .DurableRelease}}
              {{template "durable"}} AS commit
{{- else}}
              set_config('synchronous_commit', 'off', true) AS commit
{{- end}}
)
SELECT u.valid IS NOT NULL AS released, coalesce(u.valid, false) AS valid,
       c.token, c.held, c.deadline, c.owner, statement_timestamp() AS now,
{{- if .Notify}}
       CASE WHEN u.waited
           THEN num_nonnulls(pg_notify('sqllock.' || '{{.Table}}'::regclass::oid::text, $1))
           ELSE 0 END AS notified
{{- else}}
       0 AS notified
{{- end}}
FROM {{.Table}} AS c LEFT JOIN upd AS u ON true
WHERE c.key = $1
