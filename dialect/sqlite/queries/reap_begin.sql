{{- /*
reap_begin: the first statement of a reap's transaction (BEGIN IMMEDIATE
before it): sets the floor's reaping flag, which lets the DELETE of reap
past the trigger that refuses deletes; reap_end clears it before the
commit, so no other connection ever sees it set (docs/key-reaping.md).
*/ -}}
UPDATE {{.Floor}} SET reaping = 1
