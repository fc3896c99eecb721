{{- /*
list: the keys in [?1, ?2), ?1 the prefix and ?2 the first string after
every string that starts with it (prefixEnd): a range of the primary key in
byte order, with no LIKE to hide a wildcard; a key released inside its min
hold is listed as held (docs/sqlite-statements.md#list).
*/ -}}
SELECT key, token, owner, (held OR coalesce(hold_until > {{.Now}}, 0)) AND deadline > {{.Now}}, deadline, {{.Now}}, value
FROM {{.Table}} WHERE key >= ?1 AND key < ?2 ORDER BY key
