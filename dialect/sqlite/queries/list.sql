{{- /*
list: the keys in [?1, ?2), ?1 the prefix and ?2 the first string after
every string that starts with it (prefixEnd): a range of the primary key in
byte order, with no LIKE to hide a wildcard; a key released inside its min
hold is listed as held (docs/sqlite-statements.md#list).
*/ -}}
SELECT key, token, owner, (held OR coalesce(hold_until > {{.Now}}, 0)) AND deadline > {{.Now}}, deadline, {{.Now}}, value,
	CASE WHEN held AND owner = '' AND deadline > {{.Now}} THEN shared ELSE 0 END,
	coalesce(CASE WHEN mark_deadline > {{.Now}} THEN mark_owner END, '')
FROM {{.Table}} WHERE key >= ?1 AND key < ?2 ORDER BY key
