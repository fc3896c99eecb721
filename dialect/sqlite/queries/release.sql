{{- /*
release: clears held on lease (?1, ?2) iff its token is current, records ?3
as who released, and returns the deadline (was the lease still valid?).
The holder's own release inside its min hold keeps the key taken until
hold_until; a forced release frees it at once. No row: the caller reads
peek.sql to tell why (docs/sqlite-statements.md#release).
*/ -}}
UPDATE {{.Table}} SET held = 0, owner = ?3,
	deadline   = CASE WHEN owner = ?3 AND hold_until > {{.Now}} AND deadline > {{.Now}} THEN hold_until ELSE deadline END,
	hold_until = CASE WHEN owner = ?3 THEN hold_until END
WHERE key = ?1 AND token = ?2 AND held
RETURNING deadline, {{.Now}}
