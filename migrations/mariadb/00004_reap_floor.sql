-- Reaping, 1 of 3: the token floor (a text/template rendered by package
-- migrations; .Table and .Floor are validated, quoted identifiers).
--
-- Keys that nobody holds may be deleted by the reaper (dialect/mariadb's
-- Reap), and their tokens still never go back: {{.Floor}} is a one-row
-- table whose floor is at least the largest token of every row ever
-- deleted, raised by the delete trigger (00006) in the deleting
-- transaction, and a key's first row takes floor + 1 (the acquire reads
-- it; 00005 refuses a first row at or below it). reaper is the
-- connection id of the reaper's transaction while it deletes, 0 in every
-- committed version (the reaper sets and clears it in one transaction):
-- the delete trigger lets only that transaction's deletes through.
--
-- A one-row InnoDB table rather than a sequence (MariaDB has them, not
-- transactional): its raise commits with the delete and goes with its
-- rollback, its row lock orders concurrent reapers (two cannot lower it),
-- and a locking read of it (00005) waits for a raise in flight, then
-- reads the newest committed floor. A sequence would still need that
-- check after the insert (an INSERT computes its row before it waits on a
-- conflicting one) and an order of its own between reapers.
--
-- The floor starts at 0: until now no row could be deleted, so no token
-- was ever lost with one (keys that exist keep their counters). No row of
-- {{.Table}} is touched: leases held during the upgrade keep their tokens
-- and deadlines. One DDL statement (CREATE ... SELECT, atomic), as every
-- MariaDB migration.

-- +goose Up
CREATE TABLE {{.Floor}} (
    id     TINYINT         NOT NULL PRIMARY KEY CHECK (id = 1),
    floor  BIGINT          NOT NULL CHECK (floor >= 0),
    reaper BIGINT UNSIGNED NOT NULL
) ENGINE = InnoDB
SELECT 1 AS id, 0 AS floor, 0 AS reaper;

-- +goose Down
-- Reached after 00005's down, which refuses once a key was reaped.
DROP TABLE {{.Floor}};
