{{- /*
peek: key $1's row as it is now, outside an earlier statement's snapshot
(a release that lost a race reads who won), with the database time.
*/ -}}
SELECT token, held, deadline, owner, clock_timestamp() FROM {{.Table}} WHERE key = $1
