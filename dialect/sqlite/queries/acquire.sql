{{- /*
acquire: grants key ?1 to owner ?3 for ?2 ms (value ?4, NULL for none; min
hold ?5 ms, 0 for none), or returns the row unchanged, written to itself so
that a refusal writes nothing; the caller tells a grant from the returned
row (held, owner ?3, deadline > now). The inserted row carries the key's
current token, as migration 00002's trigger requires, or for a key without
a row the floor of reaped keys + 1 (migration 00005), which the upsert
keeps: a new row's token is above every token a reaped key had
(docs/sqlite-statements.md#acquire). Rendered with .Mark (acquire_mark,
a waiting writer's), a refusal also marks the key with ?3 until now + ?2
ms unless another writer's mark is live, and a grant ends ?3's mark
(docs/shared-locks.md).
*/ -}}
INSERT INTO {{.Table}} (key, token, held, deadline, owner, value, hold_until)
VALUES (?1, coalesce((SELECT token FROM {{.Table}} WHERE key = ?1), (SELECT floor + 1 FROM {{.Floor}})), 1, {{.Now}} + max(?2, ?5), ?3, ?4, CASE WHEN ?5 > 0 THEN {{.Now}} + ?5 END)
ON CONFLICT (key) DO UPDATE SET
	token    = token + {{template "new_tenure" .}},
	held     = CASE WHEN {{template "grant" .}} THEN 1 ELSE held END,
	deadline = CASE WHEN {{template "grant" .}} THEN max(excluded.deadline, CASE WHEN owner = excluded.owner THEN coalesce(hold_until, 0) ELSE 0 END) ELSE deadline END,
	hold_until = CASE WHEN {{template "new_tenure" .}} THEN excluded.hold_until ELSE hold_until END,
	owner    = CASE WHEN {{template "grant" .}} THEN excluded.owner ELSE owner END,
	value    = CASE WHEN {{template "grant" .}} THEN excluded.value ELSE value END
{{- if .Mark}},
	mark_owner = CASE
		WHEN {{template "grant" .}} THEN CASE WHEN mark_owner = excluded.owner THEN NULL ELSE mark_owner END
		WHEN mark_owner IS NULL OR coalesce(mark_deadline, 0) <= {{.Now}} OR mark_owner = excluded.owner THEN excluded.owner
		ELSE mark_owner END,
	mark_deadline = CASE
		WHEN {{template "grant" .}} THEN CASE WHEN mark_owner = excluded.owner THEN NULL ELSE mark_deadline END
		WHEN mark_owner IS NULL OR coalesce(mark_deadline, 0) <= {{.Now}} OR mark_owner = excluded.owner THEN {{.Now}} + ?2
		ELSE mark_deadline END
{{- end}}
RETURNING token, held, deadline, owner, value, {{.Now}}, coalesce(hold_until > {{.Now}}, 0), shared,
	coalesce(CASE WHEN mark_deadline > {{.Now}} THEN mark_owner END, '')
