-- ashlock lock table for MariaDB (a text/template rendered by package
-- migrations; .Table is a validated, quoted identifier). One DDL statement
-- per migration: MariaDB's DDL is not transactional, so a migration that
-- failed half way could not be rolled back, and goose records each one
-- after its statement.
--
-- Keys and owners are VARBINARY: compared byte for byte (a prefix range is
-- an index range, with no collation folding case or trailing spaces).
-- deadline and hold_until are DATETIME(6) in UTC, computed by the server
-- itself (UTC_TIMESTAMP(6)): DATETIME is stored as given, with no session
-- time-zone conversion (TIMESTAMP would convert). hold_until is the
-- grant's time + its MinHold, NULL for none.

-- +goose Up
CREATE TABLE {{.Table}} (
    `key`      VARBINARY(512)  NOT NULL PRIMARY KEY,
    token      BIGINT          NOT NULL CHECK (token > 0),
    held       BOOLEAN         NOT NULL,
    deadline   DATETIME(6)     NOT NULL,
    owner      VARBINARY(512)  NOT NULL,
    value      VARBINARY(4096) NULL,
    hold_until DATETIME(6)     NULL
) ENGINE = InnoDB;

-- +goose Down
-- WARNING: this drops the lock table and DISCARDS THE TOKEN HISTORY. Fencing
-- tokens restart from 1 afterwards. Only for uninstalling ashlock.
DROP TABLE {{.Table}};
