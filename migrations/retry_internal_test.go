package migrations

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"testing"

	"github.com/pressly/goose/v3"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/sqlitecode"
	"go.uber.org/multierr"
	msqlite "modernc.org/sqlite"
)

// Up's busy detection relies on modernc's error type having Code() int.
var _ interface{ Code() int } = (*msqlite.Error)(nil)

type fakeCode int

func (c fakeCode) Error() string { return fmt.Sprintf("fake sqlite error (%d)", int(c)) }
func (c fakeCode) Code() int     { return int(c) }

func TestSQLiteErrorClassification(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "c.db")
	open := func() *sql.DB {
		// busy_timeout(0): a lock conflict fails at once.
		db, err := sql.Open("sqlite", path+"?_pragma=busy_timeout(0)&_pragma=journal_mode(WAL)")
		require.NoError(t, err)
		t.Cleanup(func() { require.NoError(t, db.Close()) })
		db.SetMaxOpenConns(1)
		return db
	}
	a, b := open(), open()

	_, err := a.ExecContext(ctx, `CREATE TABLE t (x INTEGER)`)
	require.NoError(t, err)
	_, exists := a.ExecContext(ctx, `CREATE TABLE t (x INTEGER)`)
	require.Error(t, exists)
	_, noTable := a.ExecContext(ctx, `SELECT * FROM missing`)
	require.Error(t, noTable)

	tx, err := a.BeginTx(ctx, nil)
	require.NoError(t, err)
	_, err = tx.ExecContext(ctx, `INSERT INTO t VALUES (1)`)
	require.NoError(t, err)
	_, busy := b.ExecContext(ctx, `INSERT INTO t VALUES (2)`)
	require.Error(t, busy)
	require.NoError(t, tx.Rollback())

	c, ok := sqlitecode.Primary(busy)
	require.True(t, ok, "modernc's error carries a code: %v", busy)
	require.Equal(t, sqlitecode.Busy, c)

	for name, tc := range map[string]struct {
		err          error
		busy, exists bool
	}{
		"RealBusy":        {err: busy, busy: true},
		"RealExists":      {err: exists, exists: true},
		"RealNoTable":     {err: noTable},
		"Wrapped":         {err: fmt.Errorf("failed to initialize: %w", busy), busy: true},
		"Partial":         {err: &goose.PartialError{Failed: &goose.MigrationResult{Source: &goose.Source{Type: goose.TypeSQL, Version: 1}}, Err: exists}, exists: true},
		"Multi":           {err: multierr.Append(busy, errors.New("rollback failed")), busy: true},
		"BusySnapshot":    {err: fakeCode(517), busy: true},
		"BusyTimeout":     {err: fakeCode(773), busy: true},
		"Locked":          {err: fakeCode(6), busy: true},
		"LockedShared":    {err: fakeCode(262), busy: true},
		"ReadOnly":        {err: fakeCode(8)},
		"IOErr":           {err: fakeCode(10)},
		"CodeOverMessage": {err: fmt.Errorf("database is locked: %w", fakeCode(19))},
		"NoCodeLocked":    {err: errors.New("database is locked"), busy: true},
		"NoCodeExists":    {err: errors.New(`table "x" already exists`), exists: true},
		"Other":           {err: errors.New("boom")},
	} {
		require.Equal(t, tc.busy, isSQLiteBusy(tc.err), "%s busy: %v", name, tc.err)
		require.Equal(t, tc.exists, isSQLiteExists(tc.err), "%s exists: %v", name, tc.err)
	}
}
