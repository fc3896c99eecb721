{{- /*
set_token (tests): key ?1 exists, released, with token ?2.
*/ -}}
INSERT INTO {{.Table}} (key, token, held, deadline, owner) VALUES (?1, ?2, 0, {{.Now}}, '')
ON CONFLICT (key) DO UPDATE SET token = excluded.token, held = 0, deadline = excluded.deadline
