-- A value per lease (a text/template rendered by package migrations; .Table
-- is a validated, quoted identifier).
--
-- "value" holds the opaque bytes a holder publishes with its grant (an
-- election leader's address, say; at most 4096 bytes, checked by the
-- library before any I/O), NULL for none. Every grant sets it; a renewal or
-- a release leaves it. Adding a nullable column rewrites no row, so leases
-- held during the upgrade keep their tokens and deadlines.
--
-- Upgrade every process that uses the file: an ashlock from before this
-- migration keeps working (its statements never name the column, and its
-- grants leave the previous holder's value in place, which only List shows).

-- +goose Up
ALTER TABLE {{.Table}} ADD COLUMN value BLOB;

-- +goose Down
ALTER TABLE {{.Table}} DROP COLUMN value;
