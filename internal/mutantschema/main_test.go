package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// orig has one of each kind of function a dispatcher must copy the
// signature of.
const orig = `package main

import (
	"fmt"
	"os"
	"strings"
)

type box[T any] struct{ v T }

const (
	greeting = "h" + ("i")
	width    = 2
)

func (b *box[T]) get() T { return b.v }

type counter int

func (counter) add(_ int, n ...int) (sum int) {
	for _, x := range n {
		sum += x
	}
	return sum
}

func first[T any](xs []T) T { return xs[0] }

func say(s string) {
	fmt.Println(s)
}

func main() {
	b := &box[string]{v: "box"}
	say(b.get())
	fmt.Println(counter(0).add(9, 1, 2, 3))
	fmt.Println(first([]int{7, 8}))
	fmt.Println(strings.Repeat("-", width), len(os.Args) > 0)
	say(greeting)
}
`

func TestSchemaSwitchesEachMutant(t *testing.T) {
	dir := t.TempDir()
	mutants := []struct{ name, from, to, want string }{
		{"", "", "", "box\n6\n7\n-- true\nhi\n"},
		{"m/sum", "sum += x", "sum -= x", "box\n-6\n7\n-- true\nhi\n"},
		{"m/first", "return xs[0]", "return xs[1]", "box\n6\n8\n-- true\nhi\n"},
		{"m/get", "return b.v }", "var z T; return z }", "\n6\n7\n-- true\nhi\n"},
		{"m/greeting", `("i")`, `("o")`, "box\n6\n7\n-- true\nho\n"},
		{"m/say", "fmt.Println(s)", "fmt.Println(s, s)", "box box\n6\n7\n-- true\nhi hi\n"},
	}
	var ms []mutant
	for _, m := range mutants[1:] {
		if !strings.Contains(orig, m.from) {
			t.Fatalf("%s: %q not in the file", m.name, m.from)
		}
		ms = append(ms, mutant{name: m.name, src: []byte(strings.Replace(orig, m.from, m.to, 1))})
	}
	// Refused: a changed const, a new function, a file that does not parse.
	bad := []mutant{
		{name: "r/import", src: []byte(strings.Replace(orig, `"strings"`, `"strings"; "sort"`, 1))},
		{name: "r/added", src: []byte(orig + "\nfunc extra() {}\n")},
		{name: "r/parse", src: []byte(strings.Replace(orig, "func main() {", "func main() {{", 1))},
		{name: "r/width", src: []byte(strings.Replace(orig, "width    = 2", "width    = 3", 1))},
		{name: "r/none", src: []byte(orig + "\n// a comment\n")},
	}
	res, err := schema("main.go", []byte(orig), append(ms, bad...), "x")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range bad {
		if _, ok := res.refused[m.name]; !ok {
			t.Errorf("%s taken, want refused", m.name)
		}
	}
	for _, m := range ms {
		if r, ok := res.refused[m.name]; ok {
			t.Errorf("%s refused: %s", m.name, r)
		}
	}
	if got, want := strings.Count(string(res.src), "\n"), strings.Count(orig, "\n"); !strings.HasPrefix(string(res.src), "package main; import sqllockmutantos \"os\"\n") || got < want {
		t.Fatalf("schema does not start with the import on the package line:\n%s", res.src)
	}
	if err := os.WriteFile(filepath.Join(dir, "main.go"), res.src, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "go.mod"), []byte("module x\n\ngo 1.26.0\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "x")
	build := exec.Command("go", "build", "-o", bin, ".")
	build.Dir = dir
	build.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("schema does not build: %v\n%s\n%s", err, out, res.src)
	}
	for _, m := range mutants {
		report := filepath.Join(dir, "report")
		_ = os.Remove(report)
		run := exec.Command(bin)
		run.Env = append(os.Environ(), "SQLLOCK_MUTANT_GO="+m.name, "SQLLOCK_MUTANT_GO_REPORT="+report)
		out, err := run.Output()
		if err != nil {
			t.Fatalf("%q: %v", m.name, err)
		}
		if string(out) != m.want {
			t.Errorf("with %q: got %q, want %q", m.name, out, m.want)
		}
		planted, _ := os.ReadFile(report)
		if want := map[bool]string{true: "", false: "planted " + m.name + "\n"}[m.name == ""]; string(planted) != want {
			t.Errorf("with %q: report %q, want %q", m.name, planted, want)
		}
	}
}
