{{- /*
fence: starts a fenced transaction: locks lease ($1, $2) FOR SHARE iff it
is held and unexpired, so that no acquire can grant the key until the
transaction ends, and reports the row to explain a miss. From version 7,
$3 is the key of reader slot $1 (NULL for a key that is no slot): the
slot's lease is live only while its key is held shared by an epoch at or
below $2 (as shared_renew checks), so that key's row is checked and
locked FOR SHARE too, first (the order every shared statement locks in):
a forced release of the key ends its readers' fences as it ends their
renewals, and waits for a fenced transaction under way.
*/ -}}
WITH now AS MATERIALIZED (
    SELECT clock_timestamp() AS now
){{if ge .Version 7}}, kl AS MATERIALIZED (
    SELECT c.key FROM {{.Table}} AS c, now AS n
    WHERE c.key = $3::text AND c.held AND c.owner = '' AND c.deadline > n.now AND c.epoch <= $2
    FOR SHARE OF c
){{end}}, locked AS MATERIALIZED (
    SELECT l.deadline FROM {{.Table}} AS l, now AS n
    WHERE l.key = $1 AND l.token = $2 AND l.held AND l.deadline > n.now
{{- if ge .Version 7}}
      AND ($3::text IS NULL OR EXISTS (SELECT FROM kl))
{{- end}}
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
