{{- /*
compact_measure (compact.go): the table's live rows, the bytes they take in
heap pages (each row's tuple, aligned to 8 bytes, and its 4-byte line
pointer), and the table's pages, its size and its indexes' size on disk.
*/ -}}
SELECT count(*),
       coalesce(sum((pg_column_size(l.*) + 7) / 8 * 8 + 4), 0)::bigint,
       (pg_relation_size('{{.Table}}'::regclass) / current_setting('block_size')::bigint),
       current_setting('block_size')::bigint,
       pg_table_size('{{.Table}}'::regclass),
       pg_indexes_size('{{.Table}}'::regclass)
FROM {{.Table}} AS l
