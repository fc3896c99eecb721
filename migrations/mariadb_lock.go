package migrations

import (
	"context"
	"database/sql"
	"fmt"
	"strconv"

	"github.com/pressly/goose/v3/database"
)

// mariaDBLockTimeout is how long a MariaDB Up or Down waits for another
// host's to finish, in seconds.
const mariaDBLockTimeout = 300

// lockName is the MariaDB named lock serializing migrations of this lock
// table: per table (and per database, as GET_LOCK names are server-wide).
func (o Options) lockName() string {
	return "ashlock/migrations/" + strconv.FormatInt(o.lockID(), 16)
}

// mariaDBLocker is a goose session locker on MariaDB's GET_LOCK, held by
// the one connection goose pins for the migrations (a named lock ends with
// its session, so a crashed migrator frees it).
type mariaDBLocker struct{ name string }

func (l mariaDBLocker) SessionLock(ctx context.Context, conn *sql.Conn) error {
	var got sql.NullInt64
	// The lock's name is made per database (at most 52 of GET_LOCK's 64
	// characters), so two databases of one server do not wait for each
	// other.
	err := conn.QueryRowContext(ctx, `SELECT GET_LOCK(CONCAT(?, '/', LEFT(MD5(COALESCE(DATABASE(), '')), 16)), ?)`, l.name, mariaDBLockTimeout).Scan(&got)
	if err != nil {
		return fmt.Errorf("migrations: GET_LOCK: %w", err)
	}
	if !got.Valid || got.Int64 != 1 {
		return fmt.Errorf("migrations: another migration of this table held its lock for %ds", mariaDBLockTimeout)
	}
	return nil
}

func (l mariaDBLocker) SessionUnlock(ctx context.Context, conn *sql.Conn) error {
	_, err := conn.ExecContext(ctx, `DO RELEASE_LOCK(CONCAT(?, '/', LEFT(MD5(COALESCE(DATABASE(), '')), 16)))`, l.name)
	return err
}

// mariaDBStore is goose's MySQL store on the quoted version table, with a
// TableExists of its own: goose's would look for the name with its
// backticks, never find it, and fail the second Up creating the table
// again.
type mariaDBStore struct {
	database.Store
	table string // raw version table name
}

func newMariaDBStore(o Options) (*mariaDBStore, error) {
	_, _, versionTable := o.quoted(MariaDB)
	inner, err := database.NewStore(database.DialectMySQL, versionTable)
	if err != nil {
		return nil, err
	}
	return &mariaDBStore{Store: inner, table: o.table() + versionSuffix}, nil
}

// TableExists implements goose's optional table-existence check, in the
// connection's database.
func (s *mariaDBStore) TableExists(ctx context.Context, db database.DBTxConn) (bool, error) {
	const q = `SELECT EXISTS (SELECT 1 FROM information_schema.tables WHERE table_schema = DATABASE() AND table_name = ?)`
	var exists bool
	if err := db.QueryRowContext(ctx, q, s.table).Scan(&exists); err != nil {
		return false, fmt.Errorf("check version table %s: %w", s.Tablename(), err)
	}
	return exists, nil
}
