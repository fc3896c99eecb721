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

-- A row is a key's token history: deleted, the key would start again at
-- token 1 and a stale holder could pass a fencing check. ashlock never
-- deletes; this refuses a DELETE or TRUNCATE by hand (a forced release is
-- "sqllock release --force", which keeps the token).
-- +goose StatementBegin
CREATE FUNCTION {{.Keep}}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'sqllock: rows of %.% hold the fencing-token history and are never deleted', TG_TABLE_SCHEMA, TG_TABLE_NAME
        USING ERRCODE = 'restrict_violation',
              HINT = 'End a lease with "sqllock release --force" (the next holder gets a larger token). To uninstall, run "sqllock migrate down --force".';
END
$$;
-- +goose StatementEnd
CREATE TRIGGER sqllock_keep_rows BEFORE DELETE OR TRUNCATE ON {{.Table}}
    FOR EACH STATEMENT EXECUTE FUNCTION {{.Keep}}();

-- +goose Down
-- WARNING: this drops the lock table and DISCARDS THE TOKEN HISTORY. Fencing
-- tokens restart from 1 afterwards, so a resource that remembers an older,
-- higher token will reject new holders, and one that does not can be written by
-- a stale holder. Only for uninstalling ashlock. The schema is left in place.
DROP TABLE {{.Table}};
DROP FUNCTION IF EXISTS {{.Keep}}();
DROP FUNCTION IF EXISTS {{.Raise}}(); -- 00006's, if it was ever applied
