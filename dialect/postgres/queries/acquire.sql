{{- /*
acquire: grants key $1 to owner $3 for $2 µs (value $4 from 00004, min hold
$5 µs from 00005), or reports the holder, in one statement that locks no
row, writes no WAL and takes no transaction id when it refuses. With
.Notify (the waiting form, sent while the key is watched) it also marks the
holder's lease once, so that its release notifies
(docs/postgres-statements.md#acquire). From 00006 a key's first row takes
the floor of reaped keys + 1; migration 00006's trigger refuses it if a
reap raised the floor past it meanwhile (docs/key-reaping.md). From 00007
a refusal also reports the readers' count and a live writer's mark; with
.Mark (a waiting writer's form) a refusal marks the key with $3 until now
+ $2 µs unless another writer's mark is live, and a grant ends $3's mark
(docs/shared-locks.md).
*/ -}}
WITH upd AS (
    UPDATE {{.Table}} AS l
    SET token = CASE WHEN l.held AND l.deadline > statement_timestamp() THEN l.token ELSE l.token + 1 END,
        held = true,
        deadline = CASE WHEN l.held AND l.deadline > statement_timestamp()
                        THEN greatest(l.deadline, statement_timestamp() + $2::bigint * interval '1 microsecond')
{{- if ge .Version 5}}
                        ELSE statement_timestamp() + greatest($2::bigint, $5::bigint) * interval '1 microsecond' END,
{{- else}}
                        ELSE statement_timestamp() + $2::bigint * interval '1 microsecond' END,
{{- end}}
        owner = $3
{{- if ge .Version 3}},
        waited = l.waited AND l.held AND l.deadline > statement_timestamp()
{{- end}}
{{- if ge .Version 4}},
        value = $4::bytea
{{- end}}
{{- if ge .Version 5}},
        hold_until = CASE WHEN l.held AND l.deadline > statement_timestamp() THEN l.hold_until
                          WHEN $5::bigint > 0 THEN statement_timestamp() + $5::bigint * interval '1 microsecond' END
{{- end}}
{{- if and .Mark (ge .Version 7)}},
        mark_owner = CASE WHEN l.mark_owner = $3 THEN NULL ELSE l.mark_owner END,
        mark_deadline = CASE WHEN l.mark_owner = $3 THEN NULL ELSE l.mark_deadline END
{{- end}}
    WHERE l.key = $1
      AND ((l.held AND l.deadline > statement_timestamp() AND l.owner = $3)
{{- if ge .Version 5}}
           OR (((NOT l.held AND coalesce(l.hold_until <= statement_timestamp(), true)) OR l.deadline <= statement_timestamp()) AND l.token < 9223372036854775807))
{{- else}}
           OR ((NOT l.held OR l.deadline <= statement_timestamp()) AND l.token < 9223372036854775807))
{{- end}}
    RETURNING l.token, l.deadline, {{template "durable"}} AS durable
), ins AS (
{{- if ge .Version 5}}
    INSERT INTO {{.Table}} AS l (key, token, held, deadline, owner, value, hold_until)
    SELECT $1, {{if ge .Version 6}}(SELECT f.last_value + 1 FROM {{.Floor}} AS f){{else}}1{{end}}, true, statement_timestamp() + greatest($2::bigint, $5::bigint) * interval '1 microsecond', $3, $4::bytea,
           CASE WHEN $5::bigint > 0 THEN statement_timestamp() + $5::bigint * interval '1 microsecond' END
{{- else if ge .Version 4}}
    INSERT INTO {{.Table}} AS l (key, token, held, deadline, owner, value)
    SELECT $1, 1, true, statement_timestamp() + $2::bigint * interval '1 microsecond', $3, $4::bytea
{{- else}}
    INSERT INTO {{.Table}} AS l (key, token, held, deadline, owner)
    SELECT $1, 1, true, statement_timestamp() + $2::bigint * interval '1 microsecond', $3
{{- end}}
    WHERE NOT EXISTS (SELECT FROM upd) AND NOT EXISTS (SELECT FROM {{.Table}} WHERE key = $1)
    ON CONFLICT (key) DO UPDATE
    SET deadline = greatest(l.deadline, excluded.deadline)
    WHERE l.held AND l.owner = excluded.owner AND l.deadline > statement_timestamp()
    RETURNING l.token, l.deadline, {{template "durable"}} AS durable
)
{{- if and .Mark (ge .Version 7)}}, mark AS (
    UPDATE {{.Table}} AS l
    SET {{if .Notify}}waited = l.waited OR (l.held AND l.deadline > statement_timestamp() AND l.owner <> $3),
        {{end}}mark_owner = CASE WHEN {{template "markable"}} THEN $3 ELSE l.mark_owner END,
        mark_deadline = CASE WHEN {{template "markable"}} THEN statement_timestamp() + $2::bigint * interval '1 microsecond' ELSE l.mark_deadline END
    WHERE l.key = (
        SELECT w.key FROM {{.Table}} AS w
        WHERE w.key = $1 AND NOT EXISTS (SELECT FROM upd) AND NOT EXISTS (SELECT FROM ins)
          AND ((w.held AND w.deadline > statement_timestamp() AND w.owner <> $3{{if .Notify}} AND NOT w.waited{{end}})
               OR w.mark_owner IS NULL OR w.mark_deadline <= statement_timestamp() OR w.mark_owner = $3)
        FOR NO KEY UPDATE OF w SKIP LOCKED)
    RETURNING set_config('synchronous_commit', 'off', true) AS async
)
{{- else if and .Notify (ge .Version 3)}}, mark AS (
    UPDATE {{.Table}} AS l
    SET waited = true
    WHERE l.key = (
        SELECT w.key FROM {{.Table}} AS w
        WHERE w.key = $1 AND w.held AND w.deadline > statement_timestamp() AND w.owner <> $3 AND NOT w.waited
        FOR NO KEY UPDATE OF w SKIP LOCKED)
    RETURNING set_config('synchronous_commit', 'off', true) AS async
)
{{- end}}
SELECT u.token IS NOT NULL OR i.token IS NOT NULL AS granted,
       coalesce(u.token, i.token, c.token, 0) AS token,
       coalesce(u.deadline, i.deadline, c.deadline, statement_timestamp()) AS deadline,
{{- if ge .Version 5}}
       coalesce(u.token IS NOT NULL OR i.token IS NOT NULL OR (c.held OR coalesce(c.hold_until > statement_timestamp(), false)), false) AS held,
{{- else}}
       coalesce(u.token IS NOT NULL OR i.token IS NOT NULL OR c.held, false) AS held,
{{- end}}
       CASE WHEN u.token IS NULL AND i.token IS NULL THEN coalesce(c.owner, '') ELSE '' END AS owner,
       statement_timestamp() AS now,
{{- if and .Mark (ge .Version 7)}}
       u.token IS NULL AND i.token IS NULL AND coalesce(c.held AND c.deadline > statement_timestamp() AND c.owner <> $3
           AND ({{if .Notify}}NOT c.waited OR {{end}}c.mark_owner IS NULL OR c.mark_deadline <= statement_timestamp())
           AND NOT EXISTS (SELECT FROM mark), false) AS changed,
{{- else if and .Notify (ge .Version 3)}}
       u.token IS NULL AND i.token IS NULL AND coalesce(c.held AND c.deadline > statement_timestamp() AND c.owner <> $3 AND NOT c.waited
           AND NOT EXISTS (SELECT FROM mark), false) AS changed,
{{- else}}
       false AS changed,
{{- end}}
{{- if ge .Version 4}}
       CASE WHEN u.token IS NULL AND i.token IS NULL THEN c.value END AS value,
{{- else}}
       NULL::bytea AS value,
{{- end}}
{{- if ge .Version 7}}
       CASE WHEN c.held AND c.owner = '' AND c.deadline > statement_timestamp() THEN c.shared ELSE 0 END AS shared,
       coalesce(CASE WHEN c.mark_deadline > statement_timestamp() THEN c.mark_owner END, '') AS waiting
{{- else}}
       0 AS shared, '' AS waiting
{{- end}}
FROM (SELECT) AS one
LEFT JOIN upd AS u ON true
LEFT JOIN ins AS i ON true
LEFT JOIN {{.Table}} AS c ON c.key = $1
