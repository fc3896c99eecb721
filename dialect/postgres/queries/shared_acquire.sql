{{- /*
shared_acquire: grants key $1 shared to owner $3 for $2 µs (value $4) in one
statement, from version 7 (docs/shared-locks.md). From its snapshot it
decides (g.act): 1, a retry of $3's own live grant; 2, a new grant, in the
lowest free reader slot ($1 || '#shared-' || i: released, expired, or of
an earlier epoch) or a new one; 0, refused (K held exclusive or inside its
min hold, a live writer's mark, every slot taken, the end of the tokens).
A refusal locks no row and writes nothing. A grant locks K's row first
(kup, or kins for a key without a row) and the slot's second (sup, which
reads kup's or kins's RETURNING): the one order of every shared statement,
so two readers never deadlock. kup applies only while K's row still has
the snapshot's token, and the snapshot's live epoch, and no live mark (the
UPDATE checks its newest version): every shared or exclusive grant of K
moves K's token under K's row lock, so a reader that waited on another's
grant re-reads (its slot pick may be stale) rather than take its slot.
With .Notify (the waiting form, sent while K is watched) a refusal by an
exclusive holder also marks the holder's lease once, as acquire's waiting
form does, so that its release notifies. Each slot's row is read by its
own key (pick's LATERAL subquery, which OFFSET 0 keeps from becoming a
join): the generic plan a connection keeps knows neither the key nor
how many slots it has, and made the join a scan of the whole table.
*/ -}}
WITH k AS MATERIALIZED (
    SELECT c.token, c.held, c.deadline, c.owner, c.value, c.hold_until, c.shared, c.epoch, c.slots,
           c.mark_owner, c.mark_deadline,
           coalesce(c.held AND c.owner = '' AND c.deadline > statement_timestamp(), false) AS live,
           CASE WHEN c.key IS NULL THEN (SELECT f.last_value FROM {{.Floor}} AS f) END AS floor
    FROM (SELECT) AS one LEFT JOIN {{.Table}} AS c ON c.key = $1
), pick AS MATERIALIZED (
    SELECT p.i, s.token AS stoken, s.value AS svalue,
           coalesce(k.live AND s.held AND s.deadline > statement_timestamp() AND s.owner = $3 AND s.token >= k.epoch, false) AS retry,
           coalesce(k.live AND s.held AND s.token >= k.epoch, false) AS counted
    FROM k CROSS JOIN generate_series(1, least(coalesce(k.slots, 0) + 1, 1024)) AS p(i)
    LEFT JOIN LATERAL (SELECT r.key, r.token, r.held, r.deadline, r.owner, r.value FROM {{.Table}} AS r
                       WHERE r.key = $1 || '#shared-' || p.i OFFSET 0) AS s ON true
    WHERE s.key IS NULL OR NOT k.live OR NOT s.held OR s.deadline <= statement_timestamp() OR s.token < k.epoch
       OR s.owner = $3
    ORDER BY 4 DESC, p.i
    LIMIT 1
), g AS MATERIALIZED (
    SELECT k.*, p.i, p.stoken, p.svalue, coalesce(p.counted, false) AS counted,
           CASE
               WHEN p.retry THEN 1
               WHEN NOT k.live AND ((k.held AND k.deadline > statement_timestamp())
                   OR (NOT k.held AND k.hold_until > statement_timestamp() AND k.deadline > statement_timestamp())) THEN 0
               WHEN k.mark_owner IS NOT NULL AND k.mark_deadline > statement_timestamp() THEN 0
               WHEN p.i IS NULL THEN 0
               WHEN greatest(coalesce(k.token, k.floor), coalesce(p.stoken, 0)) >= 9223372036854775807 THEN 0
               ELSE 2 END AS act,
           CASE WHEN greatest(coalesce(k.token, k.floor), coalesce(p.stoken, 0)) < 9223372036854775807
                THEN greatest(coalesce(k.token, k.floor), coalesce(p.stoken, 0)) + 1 END AS t
    FROM k LEFT JOIN pick AS p ON true
), kup AS (
    UPDATE {{.Table}} AS l
    SET token = CASE WHEN g.act = 2 THEN g.t ELSE l.token END,
        held = true,
        owner = '',
        deadline = CASE WHEN g.live THEN greatest(l.deadline, statement_timestamp() + $2::bigint * interval '1 microsecond')
                        ELSE statement_timestamp() + $2::bigint * interval '1 microsecond' END,
        value = NULL,
        hold_until = NULL,
        shared = CASE WHEN g.act = 1 OR (g.live AND g.counted) THEN l.shared WHEN g.live THEN l.shared + 1 ELSE 1 END,
        epoch = CASE WHEN g.act = 2 AND NOT g.live THEN g.t ELSE l.epoch END,
        slots = greatest(l.slots, g.i),
        waited = g.live AND l.waited
    FROM g
    WHERE l.key = $1 AND g.act > 0 AND l.token = g.token
      AND (NOT g.live OR (l.held AND l.owner = '' AND l.deadline > statement_timestamp()))
      AND (g.act = 1 OR l.mark_owner IS NULL OR l.mark_deadline <= statement_timestamp())
    RETURNING l.epoch
), kins AS (
    INSERT INTO {{.Table}} AS l (key, token, held, deadline, owner, shared, epoch, slots)
    SELECT $1, g.t, true, statement_timestamp() + $2::bigint * interval '1 microsecond', '', 1, g.t, g.i
    FROM g WHERE g.act = 2 AND g.token IS NULL
    ON CONFLICT (key) DO NOTHING
    RETURNING l.epoch
), sup AS (
    INSERT INTO {{.Table}} AS l (key, token, held, deadline, owner, value)
    SELECT $1 || '#shared-' || g.i, CASE WHEN g.act = 1 THEN g.stoken ELSE g.t END, true,
           statement_timestamp() + $2::bigint * interval '1 microsecond', $3, CASE WHEN g.act = 1 THEN g.svalue ELSE $4::bytea END
    FROM g, (SELECT epoch FROM kup UNION ALL SELECT epoch FROM kins) AS e
    ON CONFLICT (key) DO UPDATE
    SET token = excluded.token, held = true, deadline = greatest(excluded.deadline, CASE WHEN l.token = excluded.token THEN l.deadline END),
        owner = excluded.owner, value = excluded.value, hold_until = NULL, waited = false
    WHERE (l.held AND l.token = excluded.token AND l.owner = excluded.owner AND l.deadline > statement_timestamp())
       OR ((NOT l.held OR l.deadline <= statement_timestamp() OR l.token < (SELECT epoch FROM kup UNION ALL SELECT epoch FROM kins))
           AND l.token < excluded.token)
    RETURNING l.key, l.token, l.deadline, l.value, {{template "durable"}} AS durable
)
{{- if .Notify}}, mark AS (
    UPDATE {{.Table}} AS l
    SET waited = true
    WHERE l.key = (
        SELECT w.key FROM {{.Table}} AS w, g
        WHERE w.key = $1 AND g.act = 0 AND w.held AND w.deadline > statement_timestamp() AND w.owner <> '' AND w.owner <> $3 AND NOT w.waited
        FOR NO KEY UPDATE OF w SKIP LOCKED)
    RETURNING set_config('synchronous_commit', 'off', true) AS async
)
{{- end}}
SELECT s.key IS NOT NULL AS granted, coalesce(s.key, ''), coalesce(s.token, 0), coalesce(s.deadline, statement_timestamp()), s.value,
       coalesce(g.token, 0), coalesce(g.held, false), coalesce(g.deadline, statement_timestamp()), coalesce(g.owner, ''), g.value,
       coalesce(g.hold_until > statement_timestamp(), false), coalesce(g.shared, 0), g.live,
       coalesce(CASE WHEN g.mark_deadline > statement_timestamp() THEN g.mark_owner END, ''),
       coalesce(g.mark_deadline, statement_timestamp()), statement_timestamp()
FROM g LEFT JOIN sup AS s ON true
