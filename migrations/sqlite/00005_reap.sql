-- Reaping: keys that nobody holds may be deleted, and their tokens still
-- never go back (a text/template rendered by package migrations; .Table,
-- .Keep, .ForwardReplace, .Floor and .Raise are validated, quoted
-- identifiers).
--
-- {{.Floor}} holds the floor: the largest token of every row ever deleted.
-- A key's first row takes floor + 1 (the acquire statements read it), so a
-- key reaped and acquired again continues above every token it had. SQLite
-- runs one write transaction at a time, so a statement that reads the
-- floor and inserts sees every delete committed before it, and none after.
--
--   - The AFTER DELETE trigger {{.Raise}} raises the floor in the deleting
--     statement itself: no delete can forget it.
--   - The DELETE-refusing trigger {{.Keep}} stays, except while the
--     floor's "reaping" flag is set: the reaper sets it, deletes, and
--     clears it in one transaction, so no other connection ever sees it
--     set, and a plain "DELETE FROM" by the application is still refused.
--   - {{.ForwardReplace}} now also refuses a first row at or below the
--     floor: an ashlock from before this migration inserts token 1 for a
--     key that has no row, so after a reap its acquire fails, closed,
--     never granting a reaped key a token it had. A semaphore's rows
--     (keys containing "#permit": its limit row carries the limit, not a
--     token) are never reaped, so they are exempt. Keys that were never
--     reaped are unaffected while the floor is 0, and the floor starts at
--     0: until this migration no row could be deleted, so no token was
--     ever lost with one.

-- +goose Up
CREATE TABLE {{.Floor}} (
    one     INTEGER NOT NULL PRIMARY KEY CHECK (one = 1),
    floor   INTEGER NOT NULL CHECK (floor >= 0),
    reaping INTEGER NOT NULL DEFAULT 0 CHECK (reaping IN (0, 1))
) STRICT;
INSERT INTO {{.Floor}} (one, floor) VALUES (1, 0);

DROP TRIGGER {{.Keep}};
-- +goose StatementBegin
CREATE TRIGGER {{.Keep}} BEFORE DELETE ON {{.Table}}
    WHEN (SELECT reaping FROM {{.Floor}}) IS NOT 1
BEGIN
    SELECT RAISE(ABORT, 'sqllock: rows of the lock table hold the fencing-token history and are never deleted; end a lease with "sqllock release --force", remove ended keys with "sqllock prune"');
END;
-- +goose StatementEnd
-- +goose StatementBegin
CREATE TRIGGER {{.Raise}} AFTER DELETE ON {{.Table}}
BEGIN
    UPDATE {{.Floor}} SET floor = max(floor, OLD.token);
END;
-- +goose StatementEnd

DROP TRIGGER {{.ForwardReplace}};
-- +goose StatementBegin
CREATE TRIGGER {{.ForwardReplace}} BEFORE INSERT ON {{.Table}}
    WHEN NEW.token < coalesce((SELECT token FROM {{.Table}} WHERE key = NEW.key), (SELECT floor + 1 FROM {{.Floor}}))
         AND NEW.key NOT LIKE '%#permit%'
BEGIN
    SELECT RAISE(ABORT, 'sqllock: a fencing token never goes backwards (a REPLACE would lower it, or a first row would start at or below the floor of reaped keys: upgrade every process that uses the file); end a lease with "sqllock release --force"');
END;
-- +goose StatementEnd

-- +goose Down
-- Refused once a key was reaped (the CHECK on "one" fails): without the
-- floor, a reaped key would start again at token 1.
INSERT INTO {{.Floor}} (one, floor) SELECT 2, 0 FROM {{.Floor}} WHERE floor > 0;
DROP TRIGGER {{.ForwardReplace}};
-- +goose StatementBegin
CREATE TRIGGER {{.ForwardReplace}} BEFORE INSERT ON {{.Table}}
    WHEN NEW.token < (SELECT token FROM {{.Table}} WHERE key = NEW.key)
BEGIN
    SELECT RAISE(ABORT, 'sqllock: a fencing token never goes backwards (a REPLACE would lower it); end a lease with "sqllock release --force"');
END;
-- +goose StatementEnd
DROP TRIGGER {{.Raise}};
DROP TRIGGER {{.Keep}};
-- +goose StatementBegin
CREATE TRIGGER {{.Keep}} BEFORE DELETE ON {{.Table}}
BEGIN
    SELECT RAISE(ABORT, 'sqllock: rows of the lock table hold the fencing-token history and are never deleted; end a lease with "sqllock release --force"');
END;
-- +goose StatementEnd
DROP TABLE {{.Floor}};
