{{- /*
peek: key ?1's row as it is now (read-only), with the database time.
*/ -}}
SELECT token, held, deadline, owner, {{.Now}} FROM {{.Table}} WHERE key = ?1
