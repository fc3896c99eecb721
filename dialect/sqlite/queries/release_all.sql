{{- /*
release_all: release for every lease of the JSON array ?1 of [key, token,
owner], in one statement at one instant: each row whose token is current
and held is cleared and recorded as released by its owner, with release's
min hold rule, and returned with its key and new deadline. A lease not
returned cleared nothing: the caller reads peek.sql for it, as release's
caller does (docs/multi-key.md#release-one-call-for-the-set).
*/ -}}
UPDATE {{.Table}} AS l SET held = 0, owner = r.owner,
	deadline   = CASE WHEN l.owner = r.owner AND l.hold_until > {{.Now}} AND l.deadline > {{.Now}} THEN l.hold_until ELSE l.deadline END,
	hold_until = CASE WHEN l.owner = r.owner THEN l.hold_until END
FROM (SELECT j.value ->> 0 AS key, j.value ->> 1 AS token, j.value ->> 2 AS owner FROM json_each(?1) AS j) AS r
WHERE l.key = r.key AND l.token = r.token AND l.held
RETURNING key, deadline, {{.Now}}
