-- A row is a key's token history (a text/template rendered by package
-- migrations; .Table and .Keep are validated, quoted identifiers): deleted,
-- the key would start again at token 1 and a stale holder could pass a
-- fencing check. ashlock never deletes; this refuses a DELETE, and a
-- REPLACE, which deletes the row it replaces (a REPLACE that kept the
-- row would fire the UPDATE trigger of 00002). TRUNCATE fires no trigger:
-- withhold DROP from the application's user.

-- +goose Up
-- +goose StatementBegin
CREATE TRIGGER {{.Keep}} BEFORE DELETE ON {{.Table}} FOR EACH ROW
BEGIN
    SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'sqllock: rows of the lock table hold the fencing-token history and are never deleted; end a lease with "sqllock release --force"';
END
-- +goose StatementEnd

-- +goose Down
DROP TRIGGER IF EXISTS {{.Keep}};
