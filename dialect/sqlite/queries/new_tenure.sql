{{- /*
new_tenure: over acquire's existing row, 1 iff the key may begin a new
tenure: its lease expired, or it was released and is past its min hold
(hold_until); and its token is below the largest int64, so tokens never
wrap. acquire adds it to the token (docs/sqlite-statements.md#acquire).
*/ -}}
{{define "new_tenure"}}((deadline <= {{.Now}} OR (NOT held AND coalesce(hold_until, 0) <= {{.Now}})) AND token < 9223372036854775807){{end}}
