package sqlite

import (
	"context"
	"database/sql"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
)

// makeReadOnly makes the file at path one this process cannot write: mode
// 0444, and as root (which ignores permission bits) chattr +i, undone at
// cleanup. It skips, saying why, when neither can make it read-only here:
// a test that could write the file would prove nothing.
func makeReadOnly(t *testing.T, path string) {
	t.Helper()
	require.NoError(t, os.Chmod(path, 0o444))
	if os.Geteuid() == 0 {
		out, err := exec.Command("chattr", "+i", path).CombinedOutput()
		if err != nil {
			t.Skipf("SKIPPED LOUDLY: running as root, and chattr +i failed (%v: %s): root writes any file whatever its mode, so this machine cannot show a read-only file", err, out)
		}
		t.Cleanup(func() { _ = exec.Command("chattr", "-i", path).Run() })
	}
	f, err := os.OpenFile(path, os.O_WRONLY, 0)
	if err == nil {
		f.Close()
		t.Skipf("SKIPPED LOUDLY: %s is still writable after chmod 0444 and chattr +i", path)
	}
}

// TestOpenReadOnlyFile: a lock file that cannot be written fails at Open
// (not at the first acquire), with ErrUnusable saying read-only; opened
// with ReadOnly, it can be inspected, and writes fail with ErrUnusable.
func TestOpenReadOnlyFile(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	path := filepath.Join(t.TempDir(), "locks.db")
	b, err := Open(path, Options{})
	require.NoError(t, err)
	_, err = b.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k", TTL: time.Minute, Owner: "o"})
	require.NoError(t, err)
	require.NoError(t, b.Close())
	makeReadOnly(t, path)

	_, err = Open(path, Options{})
	require.ErrorIs(t, err, ErrUnusable, "Open of a read-only lock file must fail at once")
	require.ErrorContains(t, err, "read-only")

	ro, err := Open(path, Options{ReadOnly: true})
	require.NoError(t, err)
	defer ro.Close()
	locks, err := ro.List(ctx, "")
	require.NoError(t, err)
	require.Len(t, locks, 1)
	require.Equal(t, "k", locks[0].Key)
	_, err = ro.TryAcquire(ctx, sqllock.AcquireRequest{Key: "k2", TTL: time.Minute, Owner: "o"})
	require.ErrorIs(t, err, ErrUnusable)
}

// TestOpenReadOnlyMigratesNothing: ReadOnly never migrates, so that
// inspecting a file works on one this process cannot write; mode=ro makes
// SQLite refuse writes for root too, so this holds on every machine. A
// file without the lock table reports the missing schema instead.
func TestOpenReadOnlyMigratesNothing(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	path := filepath.Join(t.TempDir(), "app.db")
	db, err := sql.Open("sqlite", path)
	require.NoError(t, err)
	_, err = db.Exec(`CREATE TABLE app (id INTEGER)`)
	require.NoError(t, err)
	require.NoError(t, db.Close())

	ro, err := Open(path, Options{ReadOnly: true})
	require.NoError(t, err)
	defer ro.Close()
	_, err = ro.List(ctx, "")
	require.ErrorIs(t, err, sqllock.ErrSchemaMissing)

	db, err = sql.Open("sqlite", path)
	require.NoError(t, err)
	defer db.Close()
	var n int
	require.NoError(t, db.QueryRow(`SELECT count(*) FROM sqlite_schema WHERE name LIKE 'sqllock%'`).Scan(&n))
	require.Zero(t, n, "a read-only Open created tables")

	_, err = DSN(path, Options{ReadOnly: true})
	require.Error(t, err)
}
