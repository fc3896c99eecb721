-- Reaping: keys that nobody holds may be deleted, and their tokens still
-- never go back (a text/template rendered by package migrations; .Table,
-- .Keep, .Floor and .Raise are validated, quoted identifiers).
--
-- {{.Floor}} is the floor: a sequence used only through setval, whose
-- last_value is at least the largest token of every row ever deleted. A
-- key's first row takes last_value + 1 (the acquire statements read it).
-- A sequence is not transactional: a raise is seen by every session at
-- once, whatever its snapshot or isolation level, and never goes back with
-- a rollback (it is WAL-logged before the delete that follows it, so a
-- crash keeps it too).
--
--   - {{.Raise}}, BEFORE DELETE FOR EACH ROW, refuses a DELETE unless the
--     deleting statement set sqllock.reap to the table's oid (the reap
--     statement does, in its WHERE; a plain "DELETE FROM" by the
--     application is refused), and raises the floor to the row's token
--     before the row goes, under an advisory lock that orders concurrent
--     reapers, so that no delete can forget it and two reapers cannot
--     lower it. TRUNCATE stays refused, always.
--   - {{.Raise}}, AFTER INSERT FOR EACH ROW, refuses a first row whose
--     token is not above the floor once the row is in. An INSERT computes
--     its row before it waits on a conflicting row, and a concurrent reap
--     may delete that row (raising the floor) while it waits: the check
--     after the insert sees the raise, and the statement fails with a
--     serialization failure, which the backend sends again. An ashlock
--     from before this migration inserts token 1: after a reap its
--     acquire of a key without a row fails, closed, never granting a
--     reaped key a token it had. A semaphore's rows (keys containing
--     "#permit": the limit row carries the limit, not a token) are never
--     reaped and are exempt.
--
-- The floor starts at 0: until this migration no row could be deleted, so
-- no token was ever lost with one (keys that exist keep their counters).
-- Catalog-only: no row is rewritten; leases held during the upgrade keep
-- their tokens and deadlines.

-- +goose Up
CREATE SEQUENCE {{.Floor}} AS bigint MINVALUE 0 START WITH 0 NO CYCLE;
-- Every role that acquires reads the floor (a first row's token, and the
-- check after the insert, which runs as that role): the lock table's
-- SELECT, INSERT and UPDATE stay all the backend needs. Raising it (setval,
-- in the reaper's delete) needs UPDATE on it, granted with DELETE on the
-- table to the role that reaps.
GRANT SELECT ON SEQUENCE {{.Floor}} TO PUBLIC;

DROP TRIGGER sqllock_keep_rows ON {{.Table}};
CREATE TRIGGER sqllock_keep_rows BEFORE TRUNCATE ON {{.Table}}
    FOR EACH STATEMENT EXECUTE FUNCTION {{.Keep}}();

-- +goose StatementBegin
CREATE OR REPLACE FUNCTION {{.Raise}}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'DELETE' THEN
        IF current_setting('sqllock.reap', true) IS DISTINCT FROM TG_RELID::text THEN
            RAISE EXCEPTION 'sqllock: rows of %.% hold the fencing-token history and are never deleted', TG_TABLE_SCHEMA, TG_TABLE_NAME
                USING ERRCODE = 'restrict_violation',
                      HINT = 'End a lease with "sqllock release --force"; remove ended keys with "sqllock prune".';
        END IF;
        PERFORM pg_advisory_xact_lock(7245291000000000000 + TG_RELID::bigint);
        IF OLD.token > (SELECT last_value FROM {{.Floor}}) THEN
            PERFORM setval('{{.Floor}}', OLD.token);
        END IF;
        RETURN OLD;
    END IF;
    IF NEW.token <= (SELECT last_value FROM {{.Floor}}) AND strpos(NEW.key, '#permit') = 0 THEN
        RAISE EXCEPTION 'sqllock: the first token % of % in %.% is not above the floor of reaped keys (a reap committed meanwhile, or an ashlock from before migration 00006)', NEW.token, NEW.key, TG_TABLE_SCHEMA, TG_TABLE_NAME
            USING ERRCODE = 'serialization_failure',
                  HINT = 'Upgrade every process that uses the table.';
    END IF;
    RETURN NULL;
END
$$;
-- +goose StatementEnd
DROP TRIGGER IF EXISTS sqllock_reap_floor ON {{.Table}}; -- left by this migration's down
CREATE TRIGGER sqllock_reap_floor BEFORE DELETE ON {{.Table}}
    FOR EACH ROW EXECUTE FUNCTION {{.Raise}}();
CREATE TRIGGER sqllock_above_floor AFTER INSERT ON {{.Table}}
    FOR EACH ROW EXECUTE FUNCTION {{.Raise}}();

-- +goose Down
-- Refused once a key was reaped: without the floor, a reaped key would
-- start again at token 1 behind a stale holder.
-- +goose StatementBegin
DO $$
BEGIN
    IF (SELECT last_value FROM {{.Floor}}) > 0 THEN
        RAISE EXCEPTION 'sqllock: keys of {{.Table}} were reaped; migration 00006 cannot be rolled back without letting them restart at token 1'
            USING ERRCODE = 'restrict_violation';
    END IF;
END
$$;
-- +goose StatementEnd
-- The row trigger of DELETE stays, and refuses a DELETE as before: its
-- function fails on the missing floor even with sqllock.reap set. (00001's
-- down drops it with the table and the function.)
DROP TRIGGER IF EXISTS sqllock_above_floor ON {{.Table}};
DROP SEQUENCE IF EXISTS {{.Floor}};
