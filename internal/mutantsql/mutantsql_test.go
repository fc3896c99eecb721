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
