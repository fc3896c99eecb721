-- A release notifies only when someone waits (a text/template rendered by
-- package migrations; .Table is a validated, quoted identifier).
--
-- "waited" is set by a waiting acquire (a client's Acquire, which listens
-- for releases) once per tenure, the first time it finds the key held by
-- someone else; a grant clears it; a release sends its NOTIFY only when it
-- is set. A release that nobody waits for so sends nothing: a notifying
-- transaction holds PostgreSQL's database-wide notify lock until its commit
-- is flushed, which serialized concurrent durable releases on the disk.
-- A missed mark only costs a waiter time (it polls as well), never safety.
--
-- With a constant default, ADD COLUMN changes only the catalog (PostgreSQL
-- 11+): it rewrites no row and holds its ACCESS EXCLUSIVE lock briefly.

-- +goose Up
ALTER TABLE {{.Table}} ADD COLUMN waited boolean NOT NULL DEFAULT false;

-- +goose Down
ALTER TABLE {{.Table}} DROP COLUMN IF EXISTS waited;
