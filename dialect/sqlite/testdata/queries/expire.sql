{{- /*
expire (tests): lease ?1's deadline becomes now; token and held stay.
*/ -}}
UPDATE {{.Table}} SET deadline = {{.Now}} WHERE key = ?1
