-- Reaping, 2 of 3: a key's first row is above the floor (a text/template
-- rendered by package migrations; .Table, .Floor and .Raise are
-- validated, quoted identifiers).
--
-- An AFTER INSERT row trigger: it fires only for a row that was inserted
-- (a key's first row: new, or reaped), never for the update path of
-- INSERT ... ON DUPLICATE KEY UPDATE, whose inserted values (a renewal's
-- request token, say) are not a row's token. (00002's BEFORE UPDATE
-- trigger keeps refusing a lower token on the update path.)
--
-- It reads the floor with a locking read (LOCK IN SHARE MODE): the newest
-- committed floor, after waiting for a reap in flight that raised it.
-- A plain read would not do: under READ COMMITTED a statement reads from
-- the snapshot taken when it started, and an INSERT computes its row
-- (floor + 1) before it meets, and waits on, a row a reaper is deleting;
-- once the delete commits, the insert goes on with the token it computed.
-- This check, after the row is in, sees the raise: a token at or below
-- the floor fails the statement with SQLSTATE 40001 (a serialization
-- failure, MariaDB's error 1644), which the backend sends again and whose
-- resend reads the new floor. A floor at the largest token fails with
-- error 1690 (out of range): the token space ends closed, never wraps.
-- A missing floor row fails closed.
--
-- An ashlock from before these migrations inserts token 1 for a key
-- without a row: once a key was reaped (floor > 0) that insert is
-- refused, closed, never granting a reaped key a token it had; so is a
-- renewal or release of a reaped key that found its row before the
-- delete and inserted after it. Until the first reap (floor 0) every
-- first row passes.

-- +goose Up
-- +goose StatementBegin
CREATE TRIGGER {{.Raise}} AFTER INSERT ON {{.Table}} FOR EACH ROW
BEGIN
    DECLARE f BIGINT DEFAULT NULL;
    SELECT floor INTO f FROM {{.Floor}} WHERE id = 1 LOCK IN SHARE MODE;
    IF f IS NULL OR NEW.token <= f THEN
        IF f = 9223372036854775807 THEN
            SIGNAL SQLSTATE '22003' SET MYSQL_ERRNO = 1690, MESSAGE_TEXT = 'sqllock: a key reaped at the largest token left the floor there: no first row is above it';
        END IF;
        SIGNAL SQLSTATE '40001' SET MESSAGE_TEXT = 'sqllock: a first token is not above the floor of reaped keys (a reap committed meanwhile, or an ashlock from before migration 00005: upgrade every process that uses the table)';
    END IF;
END
-- +goose StatementEnd

-- +goose Down
-- Refused once a key was reaped: without the check, an older ashlock
-- would start a reaped key again at token 1 behind a stale holder.
-- +goose StatementBegin
BEGIN NOT ATOMIC
    IF (SELECT floor FROM {{.Floor}} WHERE id = 1) > 0 THEN
        SIGNAL SQLSTATE '45000' SET MESSAGE_TEXT = 'sqllock: keys were reaped; migration 00005 cannot be rolled back without letting them restart at token 1';
    END IF;
    DROP TRIGGER IF EXISTS {{.Raise}};
END
-- +goose StatementEnd
