-- A key's token never goes backwards (a text/template rendered by package
-- migrations; .Table and .Forward are validated, quoted identifiers).
--
-- The next grant of a key takes its row's token + 1, so a row whose token was
-- lowered by hand (UPDATE ... SET token = 1, or an INSERT ... ON CONFLICT DO
-- UPDATE that does it) would hand out old tokens again, and a stale holder
-- could pass a fencing check. Renaming a key would restart the old name at
-- token 1 the same way. This refuses both; ashlock itself only ever keeps or
-- raises a token.

-- +goose Up
-- +goose StatementBegin
CREATE FUNCTION {{.Forward}}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.key IS DISTINCT FROM OLD.key THEN
        RAISE EXCEPTION 'sqllock: keys of %.% hold the fencing-token history and are never renamed (% to %)', TG_TABLE_SCHEMA, TG_TABLE_NAME, OLD.key, NEW.key
            USING ERRCODE = 'restrict_violation';
    END IF;
    RAISE EXCEPTION 'sqllock: the fencing token of % in %.% never goes backwards (% to %)', OLD.key, TG_TABLE_SCHEMA, TG_TABLE_NAME, OLD.token, NEW.token
        USING ERRCODE = 'restrict_violation',
              HINT = 'End a lease with "sqllock release --force" (the next holder gets a larger token).';
END
$$;
-- +goose StatementEnd
-- The WHEN clause is evaluated without calling the function, so ashlock's
-- own statements pay next to nothing for it.
CREATE TRIGGER sqllock_tokens_forward BEFORE UPDATE ON {{.Table}}
    FOR EACH ROW WHEN (NEW.token < OLD.token OR NEW.key IS DISTINCT FROM OLD.key)
    EXECUTE FUNCTION {{.Forward}}();

-- +goose Down
DROP TRIGGER IF EXISTS sqllock_tokens_forward ON {{.Table}};
DROP FUNCTION IF EXISTS {{.Forward}}();
