{{- /*
permit_acquire: grants one permit of semaphore $1 (limit $5) to owner $3 for
$2 µs (value $4): the permit $3 holds already (a retry after a lost reply
keeps its token and extends its deadline), else a free one (released or
expired), lowest first, skipping permit rows other transactions have
locked; only while the semaphore's limit row says $5. The first grant of a
semaphore creates its limit row and its permits (permit 1 granted) once the
limit row is in. A refusal locks no row and writes nothing (with .Notify,
the waiting form, it marks the holders' leases so that their release
notifies); its row carries the limit and the holders, as JSON, from the
same snapshot (docs/semaphores.md). The N permit rows are read one key at
a time (seen: a LATERAL lookup per permit number that OFFSET 0 keeps from
becoming a join; the count through a subquery, so that no plan is sized
by $5 and the prepared statement keeps its one generic plan instead of
planning every call, about 1 ms), and pick locks only the first of the candidates, in
order, that it can lock (a LATERAL lock under LIMIT 1, tried candidate by
candidate), so that the plan a connection keeps for the statement reads
the key's index whatever the table was like when that plan was made.
*/ -}}
WITH lim AS (
    SELECT token FROM {{.Table}} WHERE key = $1 || '#permits'
), keys AS (
    SELECT ARRAY(SELECT $1 || '#permit-' || i FROM generate_series(1, $5::int) AS i) AS a
), seen AS (
    SELECT c.*
    FROM generate_series(1, (SELECT $5::int)) AS g(i)
    CROSS JOIN LATERAL (
        SELECT p.* FROM {{.Table}} AS p WHERE p.key = $1 || '#permit-' || g.i OFFSET 0
    ) AS c
), cand AS (
    SELECT c.key, c.held AND c.deadline > statement_timestamp() AND c.owner = $3 AS mine
    FROM seen AS c
    WHERE EXISTS (SELECT FROM lim WHERE lim.token = $5)
      AND ((c.held AND c.deadline > statement_timestamp() AND c.owner = $3)
           OR ((NOT c.held OR c.deadline <= statement_timestamp()) AND c.token < 9223372036854775807))
), pick AS (
    SELECT c.key
    FROM (SELECT k.key FROM cand AS k ORDER BY k.mine DESC, length(k.key), k.key) AS k
    CROSS JOIN LATERAL (
        SELECT c.key FROM {{.Table}} AS c
        WHERE c.key = k.key
          AND ((c.held AND c.deadline > statement_timestamp() AND c.owner = $3)
               OR ((NOT c.held OR c.deadline <= statement_timestamp()) AND c.token < 9223372036854775807))
        FOR NO KEY UPDATE OF c SKIP LOCKED
    ) AS c
    LIMIT 1
), upd AS (
    UPDATE {{.Table}} AS l
    SET token = CASE WHEN l.held AND l.deadline > statement_timestamp() AND l.owner = $3 THEN l.token ELSE l.token + 1 END,
        value = CASE WHEN l.held AND l.deadline > statement_timestamp() AND l.owner = $3 THEN l.value ELSE $4::bytea END,
        waited = l.waited AND l.held AND l.deadline > statement_timestamp() AND l.owner = $3,
        held = true,
        deadline = statement_timestamp() + $2::bigint * interval '1 microsecond',
        owner = $3,
        hold_until = NULL
    FROM pick
    WHERE l.key = pick.key
      AND ((l.held AND l.deadline > statement_timestamp() AND l.owner = $3)
           OR ((NOT l.held OR l.deadline <= statement_timestamp()) AND l.token < 9223372036854775807))
    RETURNING l.key, l.token, l.deadline, {{template "durable"}} AS durable
), made AS (
    INSERT INTO {{.Table}} AS l (key, token, held, deadline, owner)
    SELECT $1 || '#permits', $5, false, statement_timestamp(), ''
    WHERE NOT EXISTS (SELECT FROM lim)
    ON CONFLICT (key) DO NOTHING
    RETURNING l.token
), ins AS (
    INSERT INTO {{.Table}} AS l (key, token, held, deadline, owner, value)
    SELECT $1 || '#permit-' || k.i, 1, k.i = 1,
           statement_timestamp() + CASE WHEN k.i = 1 THEN $2::bigint ELSE 0 END * interval '1 microsecond',
           CASE WHEN k.i = 1 THEN $3 ELSE '' END, CASE WHEN k.i = 1 THEN $4::bytea END
    FROM generate_series(1, $5::int) AS k(i)
    WHERE EXISTS (SELECT FROM made)
    ON CONFLICT (key) DO NOTHING
    RETURNING l.key, l.token, l.held, l.deadline, {{template "durable"}} AS durable
)
{{- if .Notify}}, mark AS (
    UPDATE {{.Table}} AS l
    SET waited = true
    WHERE l.key IN (
        SELECT w.key FROM {{.Table}} AS w
        WHERE w.key = ANY ((SELECT a FROM keys)::text[]) AND NOT EXISTS (SELECT FROM pick) AND EXISTS (SELECT FROM lim WHERE lim.token = $5)
          AND w.held AND w.deadline > statement_timestamp() AND w.owner <> $3 AND NOT w.waited
        FOR NO KEY UPDATE OF w SKIP LOCKED)
    RETURNING set_config('synchronous_commit', 'off', true) AS async
)
{{- end}}
SELECT coalesce(u.key, i.key, '') AS key,
       coalesce(u.token, i.token, 0) AS token,
       coalesce(u.deadline, i.deadline, statement_timestamp()) AS deadline,
       statement_timestamp() AS now,
       coalesce((SELECT token FROM lim), (SELECT token FROM made), 0) AS permits,
       -- What a refusal reports, read only for one (CASE evaluates its
       -- subqueries on demand): a grant reads no other permit.
       CASE WHEN u.key IS NULL AND i.key IS NULL THEN
           (SELECT count(*) FROM seen AS f WHERE (NOT f.held OR f.deadline <= statement_timestamp()) AND f.token < 9223372036854775807) ELSE 0 END AS free,
       CASE WHEN u.key IS NULL AND i.key IS NULL THEN
           (SELECT count(*) FROM seen AS f WHERE (NOT f.held OR f.deadline <= statement_timestamp()) AND f.token = 9223372036854775807) ELSE 0 END AS exhausted,
       CASE WHEN u.key IS NULL AND i.key IS NULL THEN
           coalesce((SELECT json_agg(json_build_object(
                        'key', h.key, 'owner', h.owner, 'token', h.token, 'value', encode(h.value, 'base64'),
                        'us', floor(extract(epoch FROM h.deadline - statement_timestamp()) * 1000000)::bigint))
                     FROM seen AS h WHERE h.held AND h.deadline > statement_timestamp()), '[]') ELSE '[]' END::text AS holders
FROM (SELECT) AS one
LEFT JOIN upd AS u ON true
LEFT JOIN (SELECT * FROM ins WHERE held) AS i ON true
