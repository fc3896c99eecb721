-- Shared (read) locks and a waiting writer's mark (a text/template rendered
-- by package migrations; .Table, .Floor and .Raise are validated, quoted
-- identifiers).
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
--   "mark_owner", "mark_deadline": a waiting writer's mark; new shared
--             grants are refused while it is live.
-- With constant defaults (or none), ADD COLUMN changes only the catalog:
-- no row is rewritten, leases held during the upgrade keep their tokens
-- and deadlines, and the ACCESS EXCLUSIVE lock is held briefly.
--
-- A reader slot's first row takes the key's next token, which may be at
-- or below the floor of reaped keys (the floor is table-wide, the key
-- older than the last reap): reader slots are never reaped, so the check
-- after a first insert exempts them as it exempts a semaphore's rows.
--
-- An ashlock from before this migration knows nothing of readers and
-- fails closed: its acquire refuses K while K's row is held (by the
-- readers' summary, owner ''), so it never grants K beside a reader.

-- +goose Up
ALTER TABLE {{.Table}}
    ADD COLUMN shared integer NOT NULL DEFAULT 0,
    ADD COLUMN epoch bigint NOT NULL DEFAULT 0,
    ADD COLUMN slots integer NOT NULL DEFAULT 0,
    ADD COLUMN mark_owner text,
    ADD COLUMN mark_deadline timestamptz;

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
    IF NEW.token <= (SELECT last_value FROM {{.Floor}}) AND strpos(NEW.key, '#permit') = 0
       AND NEW.key !~ '.#shared-[1-9][0-9]{0,3}$' THEN
        RAISE EXCEPTION 'sqllock: the first token % of % in %.% is not above the floor of reaped keys (a reap committed meanwhile, or an ashlock from before migration 00006)', NEW.token, NEW.key, TG_TABLE_SCHEMA, TG_TABLE_NAME
            USING ERRCODE = 'serialization_failure',
                  HINT = 'Upgrade every process that uses the table.';
    END IF;
    RETURN NULL;
END
$$;
-- +goose StatementEnd

-- +goose Down
-- The trigger function keeps its exemption of reader slots: it reads no
-- column of this migration, and without them no shared grant is made.
ALTER TABLE {{.Table}}
    DROP COLUMN IF EXISTS mark_deadline,
    DROP COLUMN IF EXISTS mark_owner,
    DROP COLUMN IF EXISTS slots,
    DROP COLUMN IF EXISTS epoch,
    DROP COLUMN IF EXISTS shared;
