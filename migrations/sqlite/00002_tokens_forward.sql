-- A key's token never goes backwards (a text/template rendered by package
-- migrations; .Table, .Forward and .ForwardReplace are validated, quoted
-- identifiers).
--
-- The next grant of a key takes its row's token + 1, so a row whose token was
-- lowered by hand would hand out old tokens again, and a stale holder could
-- pass a fencing check. Two ways to lower it are refused here:
--   - an UPDATE of token (or of key: renaming restarts the old name at 1);
--   - REPLACE INTO / INSERT OR REPLACE, which deletes the existing row
--     without firing DELETE triggers (unless recursive_triggers is on) and
--     inserts the new one: the BEFORE INSERT trigger sees the row it would
--     replace. ashlock's own acquire (an upsert) inserts with the row's
--     current token, so the check never refuses it.
--
-- Upgrade every process that uses the file: an ashlock from before this
-- migration inserts token 1 in its upsert, which this trigger refuses for an
-- existing key (its acquire fails with a constraint error, closed, never
-- granting twice).

-- +goose Up
-- +goose StatementBegin
CREATE TRIGGER {{.Forward}} BEFORE UPDATE OF token, key ON {{.Table}}
    WHEN NEW.token < OLD.token OR NEW.key IS NOT OLD.key
BEGIN
    SELECT RAISE(ABORT, 'sqllock: a fencing token never goes backwards and a key is never renamed; end a lease with "sqllock release --force"');
END;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE TRIGGER {{.ForwardReplace}} BEFORE INSERT ON {{.Table}}
    WHEN NEW.token < (SELECT token FROM {{.Table}} WHERE key = NEW.key)
BEGIN
    SELECT RAISE(ABORT, 'sqllock: a fencing token never goes backwards (a REPLACE would lower it); end a lease with "sqllock release --force"');
END;
-- +goose StatementEnd

-- +goose Down
DROP TRIGGER IF EXISTS {{.ForwardReplace}};
DROP TRIGGER IF EXISTS {{.Forward}};
