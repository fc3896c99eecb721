{{- /*
schema: the lock table's schema version, from its columns: 7 with 00007's
epoch (shared locks) and the floor, 6 with 00006's
token floor (a sequence, no column) and 00005's hold_until, 5 with
hold_until, 4 with 00004's value, 3 with 00003's waited, else 2 (00001 and
00002 add no column). Read once per Backend, with its first statement; an
undefined table fails the cast (docs/postgres-statements.md#versions).
*/ -}}
SELECT CASE WHEN bool_or(a.attname = 'epoch') AND to_regclass('{{.Floor}}') IS NOT NULL THEN 7
            WHEN bool_or(a.attname = 'hold_until') AND to_regclass('{{.Floor}}') IS NOT NULL THEN 6
            WHEN bool_or(a.attname = 'hold_until') THEN 5
            WHEN bool_or(a.attname = 'value') THEN 4
            WHEN bool_or(a.attname = 'waited') THEN 3
            ELSE 2 END
FROM pg_catalog.pg_attribute AS a
WHERE a.attrelid = '{{.Table}}'::regclass AND a.attnum > 0 AND NOT a.attisdropped
