-- Shared (read) locks and a waiting writer's mark (a text/template rendered
-- by package migrations; .Table is a validated, quoted identifier).
--
-- While a key K is held shared, K's row is held with an empty owner, its
-- token the latest reader's and its deadline the latest of its readers';
-- each reader holds a row of its own, K || '#shared-' || i, an ordinary
-- lease. On K's row:
--   "shared"  the readers of the current epoch not yet released;
--   "epoch"   the token of the epoch's first shared grant (a reader is
--             valid only while K is held shared by an epoch at or below its
--             token);
--   "slots"   how many reader rows K has;
--   "mark_owner", "mark_deadline" (Unix ms): a waiting writer's mark; new
--             shared grants are refused while it is live.
-- Adding columns with constant defaults rewrites no row, so leases held
-- during the upgrade keep their tokens and deadlines.
--
-- An ashlock from before this migration knows nothing of readers and
-- fails closed: its acquire refuses K while K's row is held (by the
-- readers' summary, owner ''), so it never grants K beside a reader.

-- +goose Up
ALTER TABLE {{.Table}} ADD COLUMN shared INTEGER NOT NULL DEFAULT 0;
ALTER TABLE {{.Table}} ADD COLUMN epoch INTEGER NOT NULL DEFAULT 0;
ALTER TABLE {{.Table}} ADD COLUMN slots INTEGER NOT NULL DEFAULT 0;
ALTER TABLE {{.Table}} ADD COLUMN mark_owner TEXT;
ALTER TABLE {{.Table}} ADD COLUMN mark_deadline INTEGER;

-- +goose Down
ALTER TABLE {{.Table}} DROP COLUMN mark_deadline;
ALTER TABLE {{.Table}} DROP COLUMN mark_owner;
ALTER TABLE {{.Table}} DROP COLUMN slots;
ALTER TABLE {{.Table}} DROP COLUMN epoch;
ALTER TABLE {{.Table}} DROP COLUMN shared;
