{{- /*
list: the keys that start with $1 (compared as text, so "%" and "_" are
literal), in byte order (COLLATE "C", the order of Go strings); a key
released inside its min hold (00005) is listed as held; from 00007 a key
held shared with its readers' count and a live writer's mark.
*/ -}}
SELECT l.key, l.token, l.owner,
{{- if ge .Version 5}}
       (l.held OR coalesce(l.hold_until > n.now, false)) AND l.deadline > n.now AS live, l.deadline, n.now,
{{- else}}
       l.held AND l.deadline > n.now AS live, l.deadline, n.now,
{{- end}}
       {{if ge .Version 4}}l.value{{else}}NULL::bytea{{end}} AS value,
{{- if ge .Version 7}}
       CASE WHEN l.held AND l.owner = '' AND l.deadline > n.now THEN l.shared ELSE 0 END AS shared,
       coalesce(CASE WHEN l.mark_deadline > n.now THEN l.mark_owner END, '') AS waiting
{{- else}}
       0 AS shared, '' AS waiting
{{- end}}
FROM {{.Table}} AS l, (SELECT clock_timestamp() AS now) AS n
WHERE left(l.key, length($1)) = $1
ORDER BY l.key COLLATE "C"
