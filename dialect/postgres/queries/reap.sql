{{- /*
reap: deletes at most $2 keys whose deadline is at least $1 µs before now
(released or expired that long ago: never a held, unexpired lease), except
a semaphore's rows and a key's reader slots (their numbering is the key's
own, docs/shared-locks.md; a key held shared is held, unexpired). The rows are locked FOR UPDATE SKIP LOCKED, so a row
an acquire, a renewal, a release or a fenced transaction (FOR SHARE) has
locked is skipped, never waited for, and its condition is checked again on
its newest version. The DELETE sets sqllock.reap, for this transaction,
in its WHERE, before migration 00006's row trigger runs; that trigger
raises the floor past each row's token before the row goes
(docs/key-reaping.md).
*/ -}}
WITH pick AS (
    SELECT c.key FROM {{.Table}} AS c
    WHERE c.deadline <= statement_timestamp() - $1::bigint * interval '1 microsecond'
      AND strpos(c.key, '#permit') = 0
{{- if ge .Version 7}}
      AND strpos(c.key, '#shared-') = 0
{{- end}}
    LIMIT $2
    FOR UPDATE OF c SKIP LOCKED
), gone AS (
    DELETE FROM {{.Table}} AS l
    USING pick AS p
    WHERE l.key = p.key
      AND l.deadline <= statement_timestamp() - $1::bigint * interval '1 microsecond'
      AND set_config('sqllock.reap', '{{.Table}}'::regclass::oid::text, true) IS NOT NULL
    RETURNING l.token
)
SELECT count(*) FROM gone
