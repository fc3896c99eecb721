{{- /*
markable: in acquire's waiting writer's form (.Mark), whether row l may
take $3's mark: no mark, a mark past its deadline, or $3's own (renewed).
*/ -}}
{{define "markable"}}(l.mark_owner IS NULL OR l.mark_deadline <= statement_timestamp() OR l.mark_owner = $3){{end}}
