package mariadb

import (
	"strings"
	"testing"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/testkit/mariatest"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// previousAcquireSQL is the acquire of the release before reaping: a key
// without a row is inserted with token 1 (the floor did not exist).
var previousAcquireSQL = strings.Replace(acquireSQL, "\nVALUES (?, ?, 1, ", "\nVALUES (?, 1, 1, ", 1)

// TestUpgradeToReapingKeepsLeases: a table at migration 00003 whose leases
// the previous release holds (one held, one ended long ago) is upgraded
// to 00006 (the floor, the check of first rows, the reaper's delete)
// while they are held. The migrations change no row and start the floor
// at 0. After them the held lease renews and is never reaped, the ended
// key is reaped and granted again above its old token; the previous
// release's acquire, which inserts token 1 for a key without a row, then
// fails closed, for any key without a row; a DELETE by the application is
// still refused; and the migrations cannot be rolled back past the floor.
func TestUpgradeToReapingKeepsLeases(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	db := mariatest.DB(t)
	require.NotEqual(t, acquireSQL, previousAcquireSQL, "acquireSQL lost the shape previousAcquireSQL is made from")
	p, err := migrations.NewProvider(migrations.MariaDB, db, migrations.Options{})
	require.NoError(t, err)
	_, err = p.UpTo(ctx, 3)
	require.NoError(t, err)

	old := render(previousAcquireSQL, "sqllock_locks", nowSQL, "")
	oldAcquire := func(key, owner string) (int64, error) {
		var r acquireRow
		err := db.QueryRowContext(ctx, old, key, time.Hour.Microseconds(), owner, nil, 0, 0).
			Scan(&r.token, &r.held, &r.deadline, &r.owner, &r.value, &r.now, &r.kept)
		return r.token, err
	}
	tokH, err := oldAcquire("held", "old-h")
	require.NoError(t, err)
	var tokE int64
	for range 3 {
		tokE, err = oldAcquire("ended", "old-e")
		require.NoError(t, err)
		_, err = db.ExecContext(ctx, "UPDATE sqllock_locks SET held = 0, deadline = UTC_TIMESTAMP(6) - INTERVAL 2 HOUR WHERE `key` = 'ended'")
		require.NoError(t, err)
	}
	require.EqualValues(t, 3, tokE)
	rows := func() string {
		var s string
		require.NoError(t, db.QueryRowContext(ctx, "SELECT GROUP_CONCAT(CONCAT_WS(',', `key`, token, held, deadline, owner) ORDER BY `key` SEPARATOR ';') FROM sqllock_locks").Scan(&s))
		return s
	}
	before := rows()

	require.NoError(t, migrations.Up(ctx, migrations.MariaDB, db, migrations.Options{}))
	require.Equal(t, before, rows(), "the migrations changed a lease")
	b, err := New(db, Options{})
	require.NoError(t, err)
	defer b.Close()
	require.Zero(t, floorOf(t, db, b), "no row was ever deleted before reaping")

	held := sqllock.Lease{Key: "held", Token: tokH, Owner: "old-h"}
	_, err = b.TryRenew(ctx, held, time.Hour)
	require.NoError(t, err, "the lease held across the upgrade renews")
	n, err := b.Reap(ctx, time.Hour, 100)
	require.NoError(t, err)
	require.Equal(t, 1, n, "the ended key is reaped, the held one is not")
	_, err = b.TryRenew(ctx, held, time.Hour)
	require.NoError(t, err)
	l, err := b.TryAcquire(ctx, acq("ended"))
	require.NoError(t, err)
	require.Greater(t, l.Token, tokE, "the reaped key went back below its old token: G2")

	// The previous release's acquire of a key without a row fails closed.
	_, err = oldAcquire("fresh", "old")
	var me *mysql.MySQLError
	require.ErrorAs(t, err, &me)
	require.Equal(t, "40001", string(me.SQLState[:]), "%v", err)
	i, err := b.List(ctx, "fresh")
	require.NoError(t, err)
	require.Empty(t, i, "the refused insert left a row")

	_, err = db.ExecContext(ctx, "DELETE FROM sqllock_locks WHERE `key` = 'held'")
	require.ErrorContains(t, err, "never deleted")

	// 00006 rolls back (deletes are refused again); 00005, whose check keeps
	// the previous release from token 1, does not once a key was reaped.
	_, err = p.Down(ctx)
	require.NoError(t, err)
	_, err = p.Down(ctx)
	require.ErrorContains(t, err, "keys were reaped")
	_, err = oldAcquire("fresh", "old")
	require.Error(t, err, "the check of first rows was rolled back")
}

// Before any key was reaped, every migration rolls back, and applies
// again.
func TestMigrationsDownBeforeAnyReap(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	db := mariatest.DB(t)
	require.NotEqual(t, acquireSQL, previousAcquireSQL, "acquireSQL lost the shape previousAcquireSQL is made from")
	p, err := migrations.NewProvider(migrations.MariaDB, db, migrations.Options{})
	require.NoError(t, err)
	_, err = p.Up(ctx)
	require.NoError(t, err)
	_, err = p.DownTo(ctx, 3)
	require.NoError(t, err)
	_, err = db.ExecContext(ctx, "SELECT 1 FROM sqllock_locks_floor")
	require.Error(t, err, "00004's down left the floor")
	_, err = p.Up(ctx)
	require.NoError(t, err)
}
