-- A minimum hold per lease (a text/template rendered by package migrations;
-- .Table is a validated, quoted identifier).
--
-- "hold_until" is the grant's time + its MinHold in Unix milliseconds by
-- SQLite's clock, NULL for none. Every grant sets it; a release by the
-- holder before it keeps the key taken until then (held = 0, deadline =
-- hold_until), so a job released early by one crontab is not run again by
-- another a second later. Adding a nullable column rewrites no row, so
-- leases held during the upgrade keep their tokens and deadlines, and
-- behave as leases without a minimum hold.
--
-- Upgrade every process that uses the file together: the grant condition
-- of earlier ashlock versions does not read the column, so they could take
-- a key released inside its minimum hold.

-- +goose Up
ALTER TABLE {{.Table}} ADD COLUMN hold_until INTEGER;

-- +goose Down
ALTER TABLE {{.Table}} DROP COLUMN hold_until;
