{{- /*
reap: deletes at most ?2 keys, in key order, whose deadline is at least ?1
ms before now (released or expired that long ago, so never a held,
unexpired lease), except a semaphore's rows and a key's reader slots
(their numbering is the key's own: docs/shared-locks.md); migration
00005's trigger
raises the floor to every deleted token in this statement
(docs/key-reaping.md).
*/ -}}
DELETE FROM {{.Table}}
WHERE key IN (
    SELECT c.key FROM {{.Table}} AS c
    WHERE c.deadline <= {{.Now}} - ?1 AND c.key NOT LIKE '%#permit%' AND c.key NOT LIKE '%#shared-%'
    ORDER BY c.key
    LIMIT ?2)
  AND deadline <= {{.Now}} - ?1
