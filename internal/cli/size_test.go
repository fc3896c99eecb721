package cli

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

// maxFuncLines is the longest a function of this package may be, from its
// func line to its closing brace: a command longer than that is split
// into the steps it is made of (parse, open, act, print).
const maxFuncLines = 80

// TestFunctionsAreShort keeps every function of the package, tests
// included, at most maxFuncLines long.
func TestFunctionsAreShort(t *testing.T) {
	t.Parallel()
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	require.NotEmpty(t, files)
	fset := token.NewFileSet()
	for _, name := range files {
		f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
		require.NoError(t, err)
		for _, d := range f.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok {
				continue
			}
			start, end := fset.Position(fn.Pos()), fset.Position(fn.End())
			if n := end.Line - start.Line + 1; n > maxFuncLines {
				t.Errorf("%s:%d: %s is %d lines long; split it (at most %d)", name, start.Line, fn.Name.Name, n, maxFuncLines)
			}
		}
	}
}
