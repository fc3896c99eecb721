package migrations

import (
	"context"
	"fmt"

	"github.com/pressly/goose/v3/database"
)

// postgresStore is goose's PostgreSQL store on the quoted version table, with
// two fixes for schema-qualified, quoted names:
//
//   - goose's own TableExists splits the name on "." and pastes both halves
//     into string literals, so a quoted name ("s"."t") is never found and the
//     second Up fails creating the table again; this one compares the raw,
//     validated names as parameters.
//   - the version table is created before any migration runs, so its schema
//     must exist first: CreateVersionTable creates it if needed.
type postgresStore struct {
	database.Store
	schema       string // raw; "" = current_schema()
	quotedSchema string
	table        string // raw version table name
}

func newPostgresStore(o Options) (*postgresStore, error) {
	schema, _, versionTable := o.quoted(Postgres)
	inner, err := database.NewStore(database.DialectPostgres, versionTable)
	if err != nil {
		return nil, err
	}
	return &postgresStore{
		Store:        inner,
		schema:       o.Schema,
		quotedSchema: schema,
		table:        o.table() + versionSuffix,
	}, nil
}

// TableExists implements goose's optional table-existence check.
func (s *postgresStore) TableExists(ctx context.Context, db database.DBTxConn) (bool, error) {
	const q = `SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_tables
		WHERE schemaname = COALESCE(NULLIF($1, ''), current_schema()) AND tablename = $2)`
	var exists bool
	if err := db.QueryRowContext(ctx, q, s.schema, s.table).Scan(&exists); err != nil {
		return false, fmt.Errorf("check version table %s: %w", s.Tablename(), err)
	}
	return exists, nil
}

// CreateVersionTable creates the schema if one is configured, then the table.
func (s *postgresStore) CreateVersionTable(ctx context.Context, db database.DBTxConn) error {
	if s.quotedSchema != "" {
		if _, err := db.ExecContext(ctx, "CREATE SCHEMA IF NOT EXISTS "+s.quotedSchema); err != nil {
			return fmt.Errorf("create schema %s: %w", s.quotedSchema, err)
		}
	}
	return s.Store.CreateVersionTable(ctx, db)
}
