-- ashlock lock table for SQLite (a text/template rendered by package
-- migrations; .Table is a validated, quoted identifier).
--
-- STRICT (SQLite >= 3.37) so a wrong type is an error, not silently stored.
-- deadline is Unix milliseconds, computed by SQLite itself.

-- +goose Up
CREATE TABLE {{.Table}} (
    key      TEXT    NOT NULL PRIMARY KEY,
    token    INTEGER NOT NULL CHECK (token > 0),
    held     INTEGER NOT NULL CHECK (held IN (0, 1)),
    deadline INTEGER NOT NULL, -- Unix milliseconds
    owner    TEXT    NOT NULL
) STRICT;

-- A row is a key's token history: deleted, the key would start again at
-- token 1 and a stale holder could pass a fencing check. ashlock never
-- deletes; this refuses a DELETE by hand (a forced release is
-- "sqllock release --force", which keeps the token).
-- +goose StatementBegin
CREATE TRIGGER {{.Keep}} BEFORE DELETE ON {{.Table}}
BEGIN
    SELECT RAISE(ABORT, 'sqllock: rows of the lock table hold the fencing-token history and are never deleted; end a lease with "sqllock release --force"');
END;
-- +goose StatementEnd

-- +goose Down
-- WARNING: this drops the lock table and DISCARDS THE TOKEN HISTORY. Fencing
-- tokens restart from 1 afterwards, so a resource that remembers an older,
-- higher token will reject new holders, and one that does not can be written by
-- a stale holder. Only for uninstalling ashlock.
DROP TABLE {{.Table}};
