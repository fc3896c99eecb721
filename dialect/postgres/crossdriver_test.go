package postgres

import (
	"context"
	"database/sql"
	"database/sql/driver"
	"path/filepath"
	"testing"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/dialect/sqlite"
)

// A SQLite *sql.DB handed to NewDB fails at once, before any I/O, with
// an error that names sqlite.New.
func TestNewDBRefusesSQLite(t *testing.T) {
	t.Parallel()
	db, err := sql.Open("sqlite", filepath.Join(t.TempDir(), "locks.db"))
	require.NoError(t, err)
	defer db.Close()
	_, err = NewDB(db, Options{})
	require.ErrorContains(t, err, "sqlite.New")
	require.Zero(t, db.Stats().OpenConnections, "NewDB opened a connection")
}

// A PostgreSQL *sql.DB whose driver sqlite.New cannot tell by its package
// (here a wrapper, as instrumentation libraries wrap drivers) fails at its
// first statement, with an error that names postgres.NewDB.
func TestSQLiteNewRefusesWrappedPostgres(t *testing.T) {
	t.Parallel()
	bundle := newBundle(t, Options{})
	cfg := bundle.db.Pool.Config().ConnConfig
	db := sql.OpenDB(wrapConnector{stdlib.GetConnector(*cfg)})
	defer db.Close()
	_, err := sqlite.New(db, sqlite.Options{})
	t.Log(err)
	require.ErrorContains(t, err, "postgres.NewDB")
}

// wrapConnector is a connector whose driver is of this package.
type wrapConnector struct{ c driver.Connector }

func (w wrapConnector) Connect(ctx context.Context) (driver.Conn, error) { return w.c.Connect(ctx) }
func (w wrapConnector) Driver() driver.Driver                            { return wrapDriver{w.c.Driver()} }

type wrapDriver struct{ d driver.Driver }

func (w wrapDriver) Open(name string) (driver.Conn, error) { return w.d.Open(name) }
