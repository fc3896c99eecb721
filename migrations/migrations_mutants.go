//go:build sqllock_mutants

package migrations

import "github.com/ashlock/ashlock/internal/mutantsql"

// In the mutation check's builds only: a planted migration replaces its
// file (see package mutantsql).
func init() {
	readEmbedded = mutantsql.ReadFile("migrations", embedded.ReadFile)
}
