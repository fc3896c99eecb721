-- A key's token never goes backwards (a text/template rendered by package
-- migrations; .Table and .Forward are validated, quoted identifiers).
--
-- The next grant of a key takes its row's token + 1, so a row whose token
-- was lowered by hand would hand out old tokens again, and a stale holder
-- could pass a fencing check. This refuses an UPDATE that lowers a token or
-- renames a key (renaming restarts the old name at 1). ashlock's acquire
-- (INSERT ... ON DUPLICATE KEY UPDATE) fires it too, and never lowers one.
-- TRUNCATE fires no trigger: withhold DROP from the application's user.

-- +goose Up
-- +goose StatementBegin
CREATE TRIGGER {{.Forward}} BEFORE UPDATE ON {{.Table}} FOR EACH ROW
BEGIN
    IF NEW.token < OLD.token OR NEW.`key` <> OLD.`key` THEN
        SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'sqllock: a fencing token never goes backwards and a key is never renamed; end a lease with "sqllock release --force"';
    END IF;
END
-- +goose StatementEnd

-- +goose Down
DROP TRIGGER IF EXISTS {{.Forward}};
