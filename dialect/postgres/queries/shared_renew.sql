{{- /*
shared_renew: renews reader slot $1 with token $2 to now + $3 µs, and
moves its key $4's deadline to at least that, iff the slot is held with
$2, unexpired, and $4 is held shared, unexpired, by an epoch at or below
$2 (docs/shared-locks.md). K's row is locked first (kl), the slot's second
(su, whose UPDATE joins kl), each checked again on its newest version;
then both are written. Returns whether it renewed, and both rows as the
snapshot saw them (s, k, each read once) to explain a miss.
*/ -}}
WITH s AS MATERIALIZED (
    SELECT c.key, c.token, c.held, c.owner, c.deadline FROM {{.Table}} AS c WHERE c.key = $1
), k AS MATERIALIZED (
    SELECT c.key, c.token, c.held, c.deadline, c.owner, c.epoch FROM {{.Table}} AS c WHERE c.key = $4
), kl AS (
    SELECT c.key FROM {{.Table}} AS c
    WHERE c.key = $4 AND c.held AND c.owner = '' AND c.deadline > statement_timestamp() AND c.epoch <= $2
    FOR NO KEY UPDATE OF c
), su AS (
    UPDATE {{.Table}} AS l
    SET deadline = greatest(l.deadline, statement_timestamp() + $3::bigint * interval '1 microsecond')
    FROM kl WHERE l.key = $1 AND l.token = $2 AND l.held AND l.deadline > statement_timestamp()
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
LEFT JOIN s ON true
LEFT JOIN k ON true
