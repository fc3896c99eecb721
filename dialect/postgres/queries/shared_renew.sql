{{- /*
shared_renew: renews reader slot $1 with token $2 to now + $3 µs, and
moves its key $4's deadline to at least that, iff the slot is held with
$2, unexpired, and $4 is held shared, unexpired, by an epoch at or below
$2 (docs/shared-locks.md). K's row is locked first (kl), the slot's second
(sl, which joins kl), each checked again on its newest version; then both
are written. Returns whether it renewed, and both rows as the snapshot saw
them to explain a miss.
*/ -}}
WITH kl AS (
    SELECT c.key FROM {{.Table}} AS c
    WHERE c.key = $4 AND c.held AND c.owner = '' AND c.deadline > statement_timestamp() AND c.epoch <= $2
    FOR NO KEY UPDATE OF c
), sl AS (
    SELECT c.key FROM {{.Table}} AS c JOIN kl ON true
    WHERE c.key = $1 AND c.token = $2 AND c.held AND c.deadline > statement_timestamp()
    FOR NO KEY UPDATE OF c
), su AS (
    UPDATE {{.Table}} AS l
    SET deadline = greatest(l.deadline, statement_timestamp() + $3::bigint * interval '1 microsecond')
    FROM sl WHERE l.key = sl.key
    RETURNING l.deadline, {{template "durable"}} AS durable
), ku AS (
    UPDATE {{.Table}} AS l
    SET deadline = greatest(l.deadline, su.deadline)
    FROM su WHERE l.key = $4
    RETURNING l.deadline
)
SELECT su.deadline IS NOT NULL AND ku.deadline IS NOT NULL AS renewed, coalesce(su.deadline, s.deadline, statement_timestamp()),
       s.key IS NOT NULL, coalesce(s.token, 0), coalesce(s.held, false), coalesce(s.owner, ''),
       k.key IS NOT NULL, coalesce(k.token, 0), coalesce(k.held, false), coalesce(k.deadline, statement_timestamp()),
       coalesce(k.owner, ''), coalesce(k.epoch, 0), statement_timestamp()
FROM (SELECT) AS one
LEFT JOIN su ON true
LEFT JOIN ku ON true
LEFT JOIN {{.Table}} AS s ON s.key = $1
LEFT JOIN {{.Table}} AS k ON k.key = $4
