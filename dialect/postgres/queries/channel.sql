{{- /*
channel: the table's notification channel, "sqllock.<table oid>": the OID
tells apart tables of the same name in different schemas, so their waiters
do not wake each other.
*/ -}}
SELECT 'sqllock.' || '{{.Table}}'::regclass::oid::text
