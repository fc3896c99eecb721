{{- /*
permit_acquire_batch: permit_acquire for many requests in one statement and
one commit (group commit of permits), with permit_acquire's rules at the
statement's one time. Request i asks semaphore $1[i] (limit $5[i]) for a
permit for owner $3[i], $2[i] µs, value $4[i]; requests are distinct by
(semaphore, owner), and several may ask one semaphore. Each semaphore's N
permit rows are read one key at a time, as permit_acquire reads them; of
a semaphore asked k times, the free permits (released or expired) are
locked lowest first, skipping rows other transactions have locked, until
k are locked, and the requests get them in the order they were sent. A
semaphore's refusal locks nothing and writes nothing.

A request comes back "alone" (sent again with permit_acquire, which
settles it) when this statement cannot answer it as permit_acquire
would: its semaphore has no limit row yet (the first grant creates the
semaphore), its owner holds a live permit already (a retry after a lost
reply keeps that permit and its token), or it was left without a permit
while another request of the batch took one of its semaphore (the
refusal would not name the batch's own holders). A refusal otherwise
carries the limit and the holders, as permit_acquire's does, from the
same snapshot. The plain form only: a waiting acquire (the semaphore
watched) is always sent alone.
*/ -}}
WITH req AS MATERIALIZED (
    SELECT r.ord, r.sem, r.micros, r.owner, r.value, r.lim
    FROM unnest((SELECT $1::text[]), (SELECT $2::bigint[]), (SELECT $3::text[]), (SELECT $4::bytea[]), (SELECT $5::int[]))
         WITH ORDINALITY AS r(sem, micros, owner, value, lim, ord)
), sem AS MATERIALIZED (
    SELECT s.sem, l.token AS stored
    FROM (SELECT DISTINCT r.sem FROM req AS r) AS s
    LEFT JOIN LATERAL (
        SELECT p.token FROM {{.Table}} AS p WHERE p.key = s.sem || '#permits' OFFSET 0
    ) AS l ON true
), seen AS MATERIALIZED (
    SELECT s.sem, g.i, c.key, c.token, c.held, c.deadline, c.owner, c.value
    FROM sem AS s
    CROSS JOIN LATERAL generate_series(1, s.stored::int) AS g(i)
    CROSS JOIN LATERAL (
        SELECT p.* FROM {{.Table}} AS p WHERE p.key = s.sem || '#permit-' || g.i OFFSET 0
    ) AS c
), own AS MATERIALIZED (
    SELECT DISTINCT r.ord
    FROM req AS r
    JOIN seen AS c ON c.sem = r.sem AND c.held AND c.deadline > statement_timestamp() AND c.owner = r.owner
), elig AS MATERIALIZED (
    SELECT r.ord, r.sem, row_number() OVER (PARTITION BY r.sem ORDER BY r.ord) AS rank
    FROM req AS r
    JOIN sem AS s ON s.sem = r.sem
    WHERE s.stored = r.lim AND NOT EXISTS (SELECT FROM own AS o WHERE o.ord = r.ord)
), pick AS MATERIALIZED (
    SELECT n.sem, p.key, row_number() OVER (PARTITION BY n.sem ORDER BY p.i) AS rank
    FROM (SELECT e.sem, count(*) AS k FROM elig AS e GROUP BY e.sem) AS n
    CROSS JOIN LATERAL (
        SELECT f.i, c.key
        FROM (SELECT f.i, f.key FROM seen AS f
              WHERE f.sem = n.sem AND (NOT f.held OR f.deadline <= statement_timestamp()) AND f.token < 9223372036854775807
              ORDER BY f.i) AS f
        CROSS JOIN LATERAL (
            SELECT c.key FROM {{.Table}} AS c
            WHERE c.key = f.key
              AND (NOT c.held OR c.deadline <= statement_timestamp()) AND c.token < 9223372036854775807
            FOR NO KEY UPDATE OF c SKIP LOCKED
        ) AS c
        LIMIT n.k
    ) AS p
), upd AS (
    UPDATE {{.Table}} AS l
    SET token = l.token + 1,
        value = r.value,
        waited = false,
        held = true,
        deadline = statement_timestamp() + r.micros * interval '1 microsecond',
        owner = r.owner,
        hold_until = NULL
    FROM elig AS e
    JOIN pick AS p ON p.sem = e.sem AND p.rank = e.rank
    JOIN req AS r ON r.ord = e.ord
    WHERE l.key = p.key
      AND (NOT l.held OR l.deadline <= statement_timestamp()) AND l.token < 9223372036854775807
    RETURNING e.ord, l.key, l.token, l.deadline, {{template "durable"}} AS durable
)
SELECT r.ord,
       coalesce(u.key, '') AS key,
       coalesce(u.token, 0) AS token,
       coalesce(u.deadline, statement_timestamp()) AS deadline,
       statement_timestamp() AS now,
       coalesce(s.stored, 0) AS permits,
       u.key IS NULL AND (s.stored IS NULL
                          OR EXISTS (SELECT FROM own AS o WHERE o.ord = r.ord)
                          OR EXISTS (SELECT FROM pick AS p WHERE p.sem = r.sem)) AS alone,
       -- What a refusal reports, read only for one (CASE evaluates its
       -- subqueries on demand).
       CASE WHEN u.key IS NULL THEN
           (SELECT count(*) FROM seen AS f WHERE f.sem = r.sem AND (NOT f.held OR f.deadline <= statement_timestamp()) AND f.token < 9223372036854775807) ELSE 0 END AS free,
       CASE WHEN u.key IS NULL THEN
           (SELECT count(*) FROM seen AS f WHERE f.sem = r.sem AND (NOT f.held OR f.deadline <= statement_timestamp()) AND f.token = 9223372036854775807) ELSE 0 END AS exhausted,
       CASE WHEN u.key IS NULL THEN
           coalesce((SELECT json_agg(json_build_object(
                        'key', h.key, 'owner', h.owner, 'token', h.token, 'value', encode(h.value, 'base64'),
                        'us', floor(extract(epoch FROM h.deadline - statement_timestamp()) * 1000000)::bigint))
                     FROM seen AS h WHERE h.sem = r.sem AND h.held AND h.deadline > statement_timestamp()), '[]') ELSE '[]' END::text AS holders
FROM req AS r
JOIN sem AS s ON s.sem = r.sem
LEFT JOIN upd AS u ON u.ord = r.ord
