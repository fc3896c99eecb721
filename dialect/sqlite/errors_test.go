package sqlite

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	sqlite3 "modernc.org/sqlite/lib"

	"github.com/ashlock/ashlock/internal/sqlitecode"
	"github.com/ashlock/ashlock/sqllock"
)

// TestBusyIsRetriedThenUnavailable: while another connection holds the
// write lock, an operation retries (counted in Stats) and, after the retry
// budget or when its context ends, fails with ErrUnavailable, never with a
// raw SQLITE_BUSY; once the lock is gone it succeeds.
func TestBusyIsRetriedThenUnavailable(t *testing.T) {
	t.Parallel()
	b, path := openTest(t, Options{RetryTimeout: time.Second})
	ctx := testCtx(t)
	name, err := DSN(path, Options{})
	require.NoError(t, err)
	other, err := sql.Open("sqlite", name)
	require.NoError(t, err)
	defer other.Close()
	tx, err := other.BeginTx(ctx, nil) // BEGIN IMMEDIATE: holds the write lock
	require.NoError(t, err)

	req := sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o"}
	start := time.Now()
	_, err = b.TryAcquire(ctx, req)
	require.ErrorIs(t, err, sqllock.ErrUnavailable)
	require.False(t, isBusy(err), "raw busy error leaked: %v", err)
	require.GreaterOrEqual(t, time.Since(start), time.Second, "gave up before its retry budget")
	require.Less(t, time.Since(start), 10*time.Second)
	require.Greater(t, b.Stats().BusyRetries, uint64(1))

	// The caller's context ends the retry earlier.
	b2, err := Open(path, Options{RetryTimeout: time.Minute})
	require.NoError(t, err)
	defer b2.Close()
	short, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	_, err = b2.TryAcquire(short, req)
	require.ErrorIs(t, err, sqllock.ErrUnavailable)
	require.ErrorIs(t, err, context.DeadlineExceeded)
	require.True(t, strings.Contains(err.Error(), "not applied"), err.Error())

	require.NoError(t, tx.Rollback())
	_, err = b.TryAcquire(ctx, req)
	require.NoError(t, err)
}

// TestCancelledContext: a context that is already done is reported before
// any statement runs.
func TestCancelledContext(t *testing.T) {
	t.Parallel()
	b, _ := openTest(t, Options{})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Second, Owner: "o"})
	require.ErrorIs(t, err, context.Canceled)
	all, err := b.List(testCtx(t), "")
	require.NoError(t, err)
	require.Empty(t, all)
}

type fakeSQLiteError struct {
	code int
	msg  string
}

func (e *fakeSQLiteError) Error() string { return e.msg }

func (e *fakeSQLiteError) Code() int { return e.code }

// TestTranslate: driver errors become ashlock's, once, at the boundary.
func TestTranslate(t *testing.T) {
	t.Parallel()
	b := &Backend{table: "sqllock_locks"}
	for _, tc := range []struct {
		name  string
		err   error
		write bool
		want  error
	}{
		{"NoSuchTable", &fakeSQLiteError{sqlite3.SQLITE_ERROR, "SQL logic error: no such table: sqllock_locks (1)"}, true, sqllock.ErrSchemaMissing},
		{"IOErrOnWriteIsIndeterminate", &fakeSQLiteError{sqlite3.SQLITE_IOERR | 4<<8, "disk I/O error (4106)"}, true, sqllock.ErrIndeterminate},
		{"IOErrOnReadIsUnavailable", &fakeSQLiteError{sqlite3.SQLITE_IOERR, "disk I/O error (10)"}, false, sqllock.ErrUnavailable},
		{"DiskFull", &fakeSQLiteError{sqlite3.SQLITE_FULL, "database or disk is full (13)"}, true, sqllock.ErrUnavailable},
		{"ReadOnlyIsPermanent", &fakeSQLiteError{sqlite3.SQLITE_READONLY, "attempt to write a readonly database (8)"}, true, ErrUnusable},
		{"ReadOnlyRecoveryIsTransient", &fakeSQLiteError{sqlite3.SQLITE_READONLY_RECOVERY, "attempt to write a readonly database (264)"}, true, sqllock.ErrUnavailable},
		{"NotADatabase", &fakeSQLiteError{sqlite3.SQLITE_NOTADB, "file is not a database (26)"}, false, ErrUnusable},
		{"CantOpen", &fakeSQLiteError{sqlite3.SQLITE_CANTOPEN, "unable to open database file (14)"}, false, ErrUnusable},
		{"Closed", errors.New("sql: database is closed"), true, sqllock.ErrClosed},
		{"Cancelled", context.Canceled, true, context.Canceled},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := b.translate(fmt.Errorf("wrapped: %w", tc.err), tc.write)
			require.ErrorIs(t, got, tc.want)
			if tc.want == ErrUnusable {
				// Permanent: never retried as if waiting could heal it.
				require.NotErrorIs(t, got, sqllock.ErrUnavailable)
			}
		})
	}
	require.True(t, isBusy(&fakeSQLiteError{sqlite3.SQLITE_BUSY_SNAPSHOT, "database is locked"}))
	require.True(t, isBusy(&fakeSQLiteError{sqlite3.SQLITE_LOCKED, "database table is locked"}))
	require.False(t, isBusy(&fakeSQLiteError{sqlite3.SQLITE_CONSTRAINT, "constraint"}))
	require.Nil(t, b.translate(nil, true))
}

// internal/sqlitecode spells out the codes it shares with the migrations
// package (which must not link SQLite); they must be SQLite's.
func TestSharedResultCodes(t *testing.T) {
	t.Parallel()
	require.Equal(t, sqlite3.SQLITE_ERROR, sqlitecode.Error)
	require.Equal(t, sqlite3.SQLITE_BUSY, sqlitecode.Busy)
	require.Equal(t, sqlite3.SQLITE_LOCKED, sqlitecode.Locked)
}
