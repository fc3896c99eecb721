// Package mutantsql lets the mutation check (.ci/mutants) plant a broken
// statement into a dialect's test binary that is already built, instead of
// building a binary for each such mutant: a dialect's statements are
// text/templates embedded at build time, and in builds with the
// sqllock_mutants tag (never a user's) the dialect hands them to [Plant]
// once, at init.
package mutantsql

import (
	"fmt"
	"os"
	"strings"
	"text/template"
)

// Env names the planted statement as FILE=PATH: FILE is the statement's
// file in the repository (dialect/sqlite/queries/acquire.sql), PATH the
// file whose text replaces it.
const Env = "SQLLOCK_MUTANT_QUERY"

// Plant returns t with the statement that Env names redefined from its
// replacement, when Env names a file of dir (the dialect's queries
// directory, as "dialect/sqlite/queries"), and t unchanged otherwise. It
// says on standard error what it planted, so that the mutation check can
// tell a mutant that was planted from one that was not. A replacement that
// cannot be read or parsed panics, as the embedded statement would: the
// test binary fails at once.
func Plant(t *template.Template, dir string) *template.Template {
	spec := os.Getenv(Env)
	file, path, ok := strings.Cut(spec, "=")
	if !ok || !strings.HasPrefix(file, dir+"/") {
		return t
	}
	name := strings.TrimPrefix(file, dir+"/")
	if t.Lookup(name) == nil {
		panic(fmt.Sprintf("mutantsql: %s: no statement %s", dir, name))
	}
	text, err := os.ReadFile(path)
	if err != nil {
		panic(fmt.Sprintf("mutantsql: %v", err))
	}
	t = template.Must(t.Clone())
	template.Must(t.New(name).Parse(string(text)))
	fmt.Fprintf(os.Stderr, "mutantsql: planted %s\n", file)
	return t
}
