{{- /*
reap_end: the last statement of a reap's transaction: clears the reaping
flag that reap_begin set (docs/key-reaping.md).
*/ -}}
UPDATE {{.Floor}} SET reaping = 0
