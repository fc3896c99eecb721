//go:build sqllock_mutants

package sqlite

import "github.com/ashlock/ashlock/internal/mutantsql"

// In the mutation check's builds only: a planted statement replaces its
// file of queries/ (see package mutantsql).
func init() {
	queryTemplates = mutantsql.Plant(queryTemplates, "dialect/sqlite/queries")
}
