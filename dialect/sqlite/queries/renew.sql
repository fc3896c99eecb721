{{- /*
renew: extends lease (?1, ?2) to now + ?3 ms iff it is held and unexpired,
never before its hold_until; otherwise writes the row to itself. The
returned row tells which, and why a lease is lost; no row: the key was
never granted (docs/sqlite-statements.md#renew).
*/ -}}
UPDATE {{.Table}} SET deadline = CASE
	WHEN token = ?2 AND held AND deadline > {{.Now}} THEN max({{.Now}} + ?3, coalesce(hold_until, 0))
	ELSE deadline END
WHERE key = ?1
RETURNING token, held, deadline, {{.Now}}
