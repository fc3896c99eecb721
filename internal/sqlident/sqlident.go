// Package sqlident validates and quotes the SQL identifiers (schema and table
// names) that ashlock accepts from configuration.
//
// Identifiers are pasted into SQL text, so they are validated first and quoted
// second: Validate admits only a conservative ASCII subset that is a legal
// identifier on every supported database, and the Quote functions quote it as
// well so a valid name is never reinterpreted (keywords, case).
//
// All functions are pure and safe for concurrent use.
package sqlident

import (
	"errors"
	"fmt"
	"regexp"
	"strings"

	"github.com/jackc/pgx/v5"
)

// ErrInvalidIdentifier is matched (with errors.Is) by the error Validate
// returns for a name that is not an acceptable identifier.
var ErrInvalidIdentifier = errors.New("sqlident: invalid identifier")

// MaxLen is the longest identifier accepted: PostgreSQL's NAMEDATALEN-1
// (longer names would be silently truncated by PostgreSQL).
const MaxLen = 63

// VersionSuffix turns a lock table's name into that of the table recording
// its applied migrations; the other derived names (the "_keep" trigger) are
// shorter.
const VersionSuffix = "_version"

// MaxTableLen is the longest lock table name: one whose version table name
// still fits in MaxLen.
const MaxTableLen = MaxLen - len(VersionSuffix)

// ValidateTable checks a lock table name: a valid identifier short enough
// for the names derived from it. The backends and the migrations use it
// alike, so no backend accepts a table that could never be migrated.
func ValidateTable(name string) error {
	if err := Validate(name); err != nil {
		return err
	}
	if len(name) > MaxTableLen {
		return fmt.Errorf("%w %q: a lock table name is at most %d bytes (%d here), since its version table adds %q",
			ErrInvalidIdentifier, name, MaxTableLen, len(name), VersionSuffix)
	}
	return nil
}

var identRE = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

// Validate reports whether name is an acceptable identifier: an ASCII letter
// or underscore followed by up to 62 ASCII letters, digits or underscores.
// The error names the offending value and matches ErrInvalidIdentifier.
func Validate(name string) error {
	if !identRE.MatchString(name) {
		return fmt.Errorf("%w %q: want an ASCII letter or _ followed by at most %d letters, digits or _",
			ErrInvalidIdentifier, name, MaxLen-1)
	}
	return nil
}

// QuotePostgres returns the quoted, optionally schema-qualified PostgreSQL
// name of table: `"schema"."table"`, or `"table"` when schema is empty (the
// table is then resolved through search_path). Callers validate first.
func QuotePostgres(schema, table string) string {
	if schema == "" {
		return pgx.Identifier{table}.Sanitize()
	}
	return pgx.Identifier{schema, table}.Sanitize()
}

// QuoteSQLite returns table as a double-quoted SQLite identifier, with any
// inner double quote doubled. Callers validate first.
func QuoteSQLite(table string) string {
	return `"` + strings.ReplaceAll(table, `"`, `""`) + `"`
}

// QuoteMariaDB returns table quoted as a MariaDB identifier (backticks).
func QuoteMariaDB(table string) string {
	return "`" + strings.ReplaceAll(table, "`", "``") + "`"
}
