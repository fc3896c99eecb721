-- A value per lease (a text/template rendered by package migrations; .Table
-- is a validated, quoted identifier).
--
-- "value" holds the opaque bytes a holder publishes with its grant (an
-- election leader's address, say; at most 4096 bytes, checked by the
-- library before any I/O), NULL for none. Every grant sets it; a renewal or
-- a release leaves it.
--
-- A nullable column without a default changes only the catalog: no row is
-- rewritten, leases held during the upgrade keep their tokens and
-- deadlines, and the ACCESS EXCLUSIVE lock is held briefly. A Backend of
-- this release on a table without the column keeps working for requests
-- without a value, and one from before ignores the column (its grants leave
-- the previous holder's value in place, which only List shows).

-- +goose Up
ALTER TABLE {{.Table}} ADD COLUMN value bytea;

-- +goose Down
ALTER TABLE {{.Table}} DROP COLUMN IF EXISTS value;
