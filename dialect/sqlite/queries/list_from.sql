{{- /*
list_from: list for a prefix that no string bounds from above (the empty
prefix): the keys from ?1 on.
*/ -}}
SELECT key, token, owner, (held OR coalesce(hold_until > {{.Now}}, 0)) AND deadline > {{.Now}}, deadline, {{.Now}}, value,
	CASE WHEN held AND owner = '' AND deadline > {{.Now}} THEN shared ELSE 0 END,
	coalesce(CASE WHEN mark_deadline > {{.Now}} THEN mark_owner END, '')
FROM {{.Table}} WHERE key >= ?1 ORDER BY key
