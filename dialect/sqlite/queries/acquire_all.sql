{{- /*
acquire_all: grants every key of the JSON array ?1 to owner ?3 for ?2 ms
(value ?4, NULL for none), or none of them, in one statement. blocked is
every key of the set that acquire would refuse, read before anything is
written (SQLite reads the whole SELECT of an INSERT from the table it
writes before the first insert). With none blocked, every key goes through
acquire's rules: a fresh key's first row is inserted (above the floor of
reaped keys), an existing row takes
a new tenure, or its owner's retry keeps its token. With one blocked,
only the first blocked key in key order is selected, written to itself
(excluded.held, the set's verdict, is 0) and returned to name the holder;
no other key is touched, a fresh key gets no row
(docs/multi-key.md#sqlite).
*/ -}}
WITH blocked AS (
	SELECT t.key FROM json_each(?1) AS k JOIN {{.Table}} AS t ON t.key = k.value
	WHERE NOT ({{template "new_tenure" .}} OR (t.held AND t.deadline > {{.Now}} AND t.owner = ?3))
)
INSERT INTO {{.Table}} (key, token, held, deadline, owner, value, hold_until)
SELECT s.key, coalesce((SELECT c.token FROM {{.Table}} AS c WHERE c.key = s.key), (SELECT f.floor + 1 FROM {{.Floor}} AS f)),
	NOT EXISTS (SELECT 1 FROM blocked), {{.Now}} + ?2, ?3, ?4, NULL
FROM (SELECT j.value AS key FROM json_each(?1) AS j) AS s
WHERE NOT EXISTS (SELECT 1 FROM blocked) OR s.key = (SELECT min(b.key) FROM blocked AS b)
ORDER BY s.key
ON CONFLICT (key) DO UPDATE SET
	token    = token + (excluded.held AND {{template "new_tenure" .}}),
	held     = CASE WHEN excluded.held AND {{template "grant" .}} THEN 1 ELSE held END,
	deadline = CASE WHEN excluded.held AND {{template "grant" .}} THEN max(excluded.deadline, CASE WHEN owner = excluded.owner THEN coalesce(hold_until, 0) ELSE 0 END) ELSE deadline END,
	hold_until = CASE WHEN excluded.held AND {{template "new_tenure" .}} THEN NULL ELSE hold_until END,
	owner    = CASE WHEN excluded.held AND {{template "grant" .}} THEN excluded.owner ELSE owner END,
	value    = CASE WHEN excluded.held AND {{template "grant" .}} THEN excluded.value ELSE value END
RETURNING key, token, held, deadline, owner, value, {{.Now}}, coalesce(hold_until > {{.Now}}, 0)
