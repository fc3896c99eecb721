-- ashlock lock table for PostgreSQL (a text/template rendered by package
-- migrations; .Schema and .Table are validated, quoted identifiers).
--
-- The table is LOGGED on purpose. Never make it UNLOGGED: PostgreSQL empties
-- unlogged tables after a crash, and the token history with them, so fencing
-- tokens would start again and a stale holder could pass a fencing check.

-- +goose Up
{{- if .Schema}}
CREATE SCHEMA IF NOT EXISTS {{.Schema}};
{{- end}}
CREATE TABLE {{.Table}} (
    key      text        NOT NULL PRIMARY KEY,
    token    bigint      NOT NULL CHECK (token > 0),
    held     boolean     NOT NULL,
    deadline timestamptz NOT NULL,
    owner    text        NOT NULL
);

-- +goose Down
-- WARNING: this drops the lock table and DISCARDS THE TOKEN HISTORY. Fencing
-- tokens restart from 1 afterwards, so a resource that remembers an older,
-- higher token will reject new holders, and one that does not can be written by
-- a stale holder. Only for uninstalling ashlock. The schema is left in place.
DROP TABLE {{.Table}};
