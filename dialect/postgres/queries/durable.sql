{{- /*
durable: evaluated in the RETURNING of every row a grant or renewal writes,
it raises synchronous_commit to on for the statement's own transaction
where the session has it at off or local, so that no acknowledged grant or
renewal is lost in a crash (docs/postgres-statements.md#durability).
*/ -}}
{{define "durable"}}CASE WHEN current_setting('synchronous_commit') IN ('off', 'local')
                THEN set_config('synchronous_commit', 'on', true) END{{end}}
