{{- /*
compact_left (compact.go): how many rows sit at or past page .Cut (a TID
range scan: only those pages are read).
*/ -}}
SELECT count(*) FROM {{.Table}} AS l WHERE l.ctid >= '({{.Cut}},0)'::tid
