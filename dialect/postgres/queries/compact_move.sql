{{- /*
compact_move (compact.go): one transaction that moves at most .Batch rows
from page .Cut on toward the table's start, changing nothing they hold.

It locks the rows FOR NO KEY UPDATE SKIP LOCKED, so a row that another
transaction has locked (an acquire, renewal or release in flight, a fenced
transaction's FOR SHARE) is skipped, never waited for. Then it updates
them to what they are (token = token: migration 00002's trigger lets that
through without a call) until none is left past the cut, .Rounds times at
most. PostgreSQL puts an updated row's new version on its own page while
that page has room, and only then on a page the free space map names,
searching from the start after a VACUUM. So the first rounds may fill
their own page with versions; the versions are this transaction's, which
no pruning frees before it ends, so each round either takes room on the
page or moves the row off it: after enough rounds every row left its
page. (A no-op UPDATE sent once, in a transaction of its own, leaves a
row on its page whenever the page has room: the row never moves.) The
rounds stop after .Millis milliseconds too, so that a row that finds no
room before the cut (the free space map offers pages after it) is not
held locked for long: a renewal or release of its key waits that long at
most.
The table and the numbers are pasted (.Table is the validated, quoted
identifier; .Cut, .Batch, .Rounds and .Millis are integers): a DO block takes no
parameters. Nothing of a caller's is in it.
*/ -}}
DO $compact$
DECLARE
    picked text[];
    updated bigint;
    started timestamptz := clock_timestamp();
BEGIN
    SELECT array_agg(p.key) INTO picked FROM (
        SELECT l.key FROM {{.Table}} AS l
        WHERE l.ctid >= '({{.Cut}},0)'::tid
        LIMIT {{.Batch}}
        FOR NO KEY UPDATE OF l SKIP LOCKED
    ) AS p;
    IF picked IS NULL THEN
        RETURN;
    END IF;
    FOR round IN 1..{{.Rounds}} LOOP
        UPDATE {{.Table}} AS l SET token = l.token
        WHERE l.key = ANY (picked) AND l.ctid >= '({{.Cut}},0)'::tid;
        GET DIAGNOSTICS updated = ROW_COUNT;
        EXIT WHEN updated = 0 OR clock_timestamp() > started + interval '{{.Millis}} milliseconds';
    END LOOP;
END
$compact$
