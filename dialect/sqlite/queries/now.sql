{{- /*
now: the database clock, read once for a batch renewal.
*/ -}}
SELECT {{.Now}}
