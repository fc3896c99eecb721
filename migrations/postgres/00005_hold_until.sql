-- A minimum hold per lease (a text/template rendered by package migrations;
-- .Table is a validated, quoted identifier).
--
-- "hold_until" is the grant's time + its MinHold by the server's clock,
-- NULL for none. Every grant of a new tenure sets it; a release by the
-- holder before it keeps the key taken until then (held = false, deadline
-- = hold_until), so a job released early by one crontab is not run again
-- by another a second later; a release by another owner (a forced release)
-- clears it.
--
-- A nullable column without a default changes only the catalog: no row is
-- rewritten, leases held during the upgrade keep their tokens and
-- deadlines, and behave as leases without a minimum hold; the ACCESS
-- EXCLUSIVE lock is held briefly. A Backend of this release on a table
-- without the column keeps working for requests without a minimum hold,
-- and refuses one with it. Upgrade every process that uses the table
-- together: the grant condition of earlier ashlock versions does not read
-- the column, so they could take a key released inside its minimum hold.

-- +goose Up
ALTER TABLE {{.Table}} ADD COLUMN hold_until timestamptz;

-- +goose Down
ALTER TABLE {{.Table}} DROP COLUMN IF EXISTS hold_until;
