package mutantsql

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"text/template"
)

func parse(t *testing.T) *template.Template {
	t.Helper()
	return template.Must(template.New("").Parse(`{{define "a.sql"}}SELECT {{template "b.sql"}}{{end}}{{define "b.sql"}}1{{end}}`))
}

func render(t *testing.T, tm *template.Template, name string) string {
	t.Helper()
	var b strings.Builder
	if err := tm.ExecuteTemplate(&b, name, nil); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

func TestPlantReplacesTheNamedStatement(t *testing.T) {
	path := filepath.Join(t.TempDir(), "b")
	if err := os.WriteFile(path, []byte("2"), 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv(Env, "dialect/x/queries/b.sql="+path)
	orig := parse(t)
	got := Plant(orig, "dialect/x/queries")
	if s := render(t, got, "a.sql"); s != "SELECT 2" {
		t.Fatalf("planted a.sql renders %q, want SELECT 2 (its template b.sql replaced)", s)
	}
	if s := render(t, orig, "a.sql"); s != "SELECT 1" {
		t.Fatalf("the original renders %q after Plant, want SELECT 1", s)
	}
}

func TestPlantLeavesOtherDialects(t *testing.T) {
	t.Setenv(Env, "dialect/y/queries/b.sql=/nonexistent")
	if s := render(t, Plant(parse(t), "dialect/x/queries"), "a.sql"); s != "SELECT 1" {
		t.Fatalf("renders %q, want SELECT 1: another dialect's mutant was planted here", s)
	}
	t.Setenv(Env, "")
	if s := render(t, Plant(parse(t), "dialect/x/queries"), "a.sql"); s != "SELECT 1" {
		t.Fatalf("renders %q without %s, want SELECT 1", s, Env)
	}
}

func TestPlantUnknownStatementPanics(t *testing.T) {
	t.Setenv(Env, "dialect/x/queries/c.sql=/nonexistent")
	defer func() {
		if recover() == nil {
			t.Fatal("a mutant of a statement that does not exist was silently ignored")
		}
	}()
	Plant(parse(t), "dialect/x/queries")
}

func TestReadFileReadsTheReplacementOfTheNamedFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "m")
	if err := os.WriteFile(path, []byte("mutated"), 0o600); err != nil {
		t.Fatal(err)
	}
	embedded := func(n string) ([]byte, error) { return []byte("embedded " + n), nil }
	t.Setenv(Env, "migrations/sqlite/2.sql="+path)
	read := ReadFile("migrations", embedded)
	for n, want := range map[string]string{"sqlite/2.sql": "mutated", "sqlite/1.sql": "embedded sqlite/1.sql", "postgres/2.sql": "embedded postgres/2.sql"} {
		if b, err := read(n); err != nil || string(b) != want {
			t.Errorf("read(%q) = %q, %v; want %q", n, b, err, want)
		}
	}
	for _, env := range []string{"dialect/sqlite/queries/2.sql=" + path, ""} {
		t.Setenv(Env, env)
		if b, _ := ReadFile("migrations", embedded)("sqlite/2.sql"); string(b) != "embedded sqlite/2.sql" {
			t.Errorf("with %s=%q: read %q, want the embedded file", Env, env, b)
		}
	}
}
