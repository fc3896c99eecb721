-- Reaping, 3 of 3: the reaper may delete (a text/template rendered by
-- package migrations; .Table, .Keep and .Floor are validated, quoted
-- identifiers).
--
-- 00003's trigger, replaced in one statement (CREATE OR REPLACE): a
-- DELETE (and a REPLACE, which deletes the row it replaces) is refused
-- unless its transaction is the reaper's, which set the floor row's
-- reaper to its own connection id before deleting and sets it back to 0
-- before committing: no other transaction ever reads it set (READ
-- COMMITTED or REPEATABLE READ alike), and no later statement on the
-- same pooled connection either. (A session variable would outlive the
-- transaction on the connection, and SET STATEMENT takes only system
-- variables.) A plain "DELETE FROM" by the application is refused.
--
-- Every delete that passes raises the floor to the row's token before the
-- row goes, in the deleting transaction, under the floor row's lock: no
-- delete can forget it, and two reapers cannot lower it (GREATEST, each
-- after the other). TRUNCATE fires no trigger: withhold DROP from the
-- application's user.

-- +goose Up
-- +goose StatementBegin
CREATE OR REPLACE TRIGGER {{.Keep}} BEFORE DELETE ON {{.Table}} FOR EACH ROW
BEGIN
    IF NOT (SELECT reaper FROM {{.Floor}} WHERE id = 1) <=> CONNECTION_ID() THEN
        SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'sqllock: rows of the lock table hold the fencing-token history and are never deleted; end a lease with "sqllock release --force", remove ended keys with "sqllock prune"';
    END IF;
    UPDATE {{.Floor}} SET floor = GREATEST(floor, OLD.token) WHERE id = 1;
END
-- +goose StatementEnd

-- +goose Down
-- +goose StatementBegin
CREATE OR REPLACE TRIGGER {{.Keep}} BEFORE DELETE ON {{.Table}} FOR EACH ROW
BEGIN
    SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'sqllock: rows of the lock table hold the fencing-token history and are never deleted; end a lease with "sqllock release --force"';
END
-- +goose StatementEnd
