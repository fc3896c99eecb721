{{- /*
grant: acquire's grant condition over the existing row: a new tenure, or
the same owner's unexpired hold (a retry after a lost reply keeps its token
and extends its deadline). The two exclude each other.
*/ -}}
{{define "grant"}}({{template "new_tenure" .}} OR (held AND deadline > {{.Now}} AND owner = excluded.owner)){{end}}
