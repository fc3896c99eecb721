// Package mutantsql lets the mutation check (.ci/mutants) plant a broken
// statement into a dialect's test binary that is already built, instead of
// building a binary for each such mutant: a dialect's statements are
// text/templates embedded at build time, and in builds with the
// sqllock_mutants tag (never a user's) the dialect hands them to [Plant]
// once, at init; package migrations reads its embedded files through
// [ReadFile].
package mutantsql

import (
	"fmt"
	"os"
	"strings"
	"sync"
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

// ReadFile returns read, except that the file Env names, when it is one
// of dir's (the embedded tree's root in the repository, as "migrations";
// read takes names below it, as "sqlite/00005_reap.sql"), is read from
// its replacement. The first such read says so on standard error, as
// Plant does. A replacement that cannot be read is an error of the read.
func ReadFile(dir string, read func(name string) ([]byte, error)) func(name string) ([]byte, error) {
	file, path, ok := strings.Cut(os.Getenv(Env), "=")
	if !ok || !strings.HasPrefix(file, dir+"/") {
		return read
	}
	name := strings.TrimPrefix(file, dir+"/")
	var once sync.Once
	return func(n string) ([]byte, error) {
		if n != name {
			return read(n)
		}
		once.Do(func() { fmt.Fprintf(os.Stderr, "mutantsql: planted %s\n", file) })
		return os.ReadFile(path)
	}
}
