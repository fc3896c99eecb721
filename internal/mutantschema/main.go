// Command mutantschema writes one Go file that holds several mutants of
// it at once, each switched on at run time, so that the mutation check
// (.ci/mutants) builds a package's test binary once for all of its
// mutants instead of once per mutant.
//
//	mutantschema -o OUT -id ID ORIG NAME=MUTATED...
//
// ORIG is a Go file; each MUTATED is ORIG with mutant NAME planted (the
// sed expressions applied). A mutant is taken when it changes only the
// bodies or signatures of functions and methods (never a const, var,
// type or import, never an init), so that the program can still choose,
// per call, between the original function and each mutant's: OUT is ORIG
// with every changed function F renamed F_mutant0, each mutant's version
// of F added as F_mutantN, and a new F with F's signature that calls the
// version of the mutant named by $SQLLOCK_MUTANT_GO (the original when
// it names none of them). Lines of ORIG keep their numbers.
//
// When $SQLLOCK_MUTANT_GO names one of the file's mutants, the binary
// appends "planted NAME" to the file $SQLLOCK_MUTANT_GO_REPORT at start,
// so that a run whose binary never had the mutant is never taken for a
// kill.
//
// It prints "taken NAME" or "refused NAME: REASON" for each mutant; a
// refused one is built on its own, as before. Exit status 1 only when
// ORIG cannot be read or parsed, or OUT written.
package main

import (
	"bytes"
	"flag"
	"fmt"
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"regexp"
	"slices"
	"strings"
)

func main() {
	out := flag.String("o", "", "output file")
	id := flag.String("id", "", "identifier suffix, unique in the package (letters, digits, _)")
	flag.Parse()
	if *out == "" || flag.NArg() < 1 || !regexp.MustCompile(`^[A-Za-z0-9_]+$`).MatchString(*id) {
		fmt.Fprintln(os.Stderr, "usage: mutantschema -o OUT -id ID ORIG NAME=MUTATED...")
		os.Exit(2)
	}
	orig, err := os.ReadFile(flag.Arg(0))
	if err != nil {
		fail(err)
	}
	var ms []mutant
	for _, a := range flag.Args()[1:] {
		name, path, ok := strings.Cut(a, "=")
		if !ok {
			fail(fmt.Errorf("%q: want NAME=MUTATED", a))
		}
		src, err := os.ReadFile(path)
		if err != nil {
			fail(err)
		}
		ms = append(ms, mutant{name: name, src: src})
	}
	res, err := schema(flag.Arg(0), orig, ms, *id)
	if err != nil {
		fail(err)
	}
	for _, m := range ms {
		if r, ok := res.refused[m.name]; ok {
			fmt.Printf("refused %s: %s\n", m.name, r)
		} else {
			fmt.Printf("taken %s\n", m.name)
		}
	}
	if err := os.WriteFile(*out, res.src, 0o644); err != nil {
		fail(err)
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "mutantschema:", err)
	os.Exit(1)
}

type mutant struct {
	name string
	src  []byte
}

type result struct {
	src     []byte            // the schema; ORIG itself when no mutant was taken
	refused map[string]string // mutant name -> why
}

// parsed is a file's top-level declarations: functions by key (receiver
// type and name), everything else (and the header: package clause and
// imports) as text in order.
type parsed struct {
	src    []byte
	fset   *token.FileSet
	file   *ast.File
	funcs  map[string]*ast.FuncDecl
	consts map[string]*ast.ValueSpec // string constants a mutant may change (see constSpec)
	other  []string
}

// constSpec reports whether s is a constant the schema can switch: one
// name, a value of string literals (a SQL statement, mostly). The schema keeps it
// as a constant, renamed, and makes the name a variable that holds the
// original or a mutant's text; a package that uses it where only a
// constant will do does not build with the schema, and its mutants are
// built alone.
func constSpec(tok token.Token, s ast.Spec) (*ast.ValueSpec, bool) {
	v, ok := s.(*ast.ValueSpec)
	if tok != token.CONST || !ok || len(v.Names) != 1 || len(v.Values) != 1 || v.Names[0].Name == "_" {
		return nil, false
	}
	return v, stringLits(v.Values[0])
}

// stringLits reports whether e is string literals joined by +.
func stringLits(e ast.Expr) bool {
	switch e := e.(type) {
	case *ast.BasicLit:
		return e.Kind == token.STRING
	case *ast.ParenExpr:
		return stringLits(e.X)
	case *ast.BinaryExpr:
		return e.Op == token.ADD && stringLits(e.X) && stringLits(e.Y)
	}
	return false
}

func parse(path string, src []byte) (*parsed, error) {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, path, src, parser.ParseComments|parser.SkipObjectResolution)
	if err != nil {
		return nil, err
	}
	p := &parsed{src: src, fset: fset, file: f, funcs: map[string]*ast.FuncDecl{}, consts: map[string]*ast.ValueSpec{}}
	p.other = append(p.other, "package "+f.Name.Name)
	for _, d := range f.Decls {
		switch d := d.(type) {
		case *ast.FuncDecl:
			k := funcKey(d)
			if _, dup := p.funcs[k]; dup {
				k += "#dup" // init, or a duplicate: never taken (see below)
				for p.funcs[k] != nil {
					k += "#"
				}
			}
			p.funcs[k] = d
		case *ast.GenDecl:
			// The declaration's text, each switchable constant's spec
			// replaced by its name: a mutant may change those alone.
			t, last := "", p.off(d.Pos())
			for _, sp := range d.Specs {
				v, ok := constSpec(d.Tok, sp)
				if !ok {
					continue
				}
				p.consts[v.Names[0].Name] = v
				t += string(p.src[last:p.off(v.Pos())]) + "<const " + v.Names[0].Name + ">"
				last = p.off(v.End())
			}
			p.other = append(p.other, t+string(p.src[last:p.off(d.End())]))
		default:
			p.other = append(p.other, p.text(d))
		}
	}
	return p, nil
}

func (p *parsed) off(pos token.Pos) int { return p.fset.Position(pos).Offset }

func (p *parsed) text(n ast.Node) string { return string(p.src[p.off(n.Pos()):p.off(n.End())]) }

func funcKey(d *ast.FuncDecl) string {
	if d.Recv == nil || len(d.Recv.List) == 0 {
		return d.Name.Name
	}
	t := d.Recv.List[0].Type
	if s, ok := t.(*ast.StarExpr); ok {
		t = s.X
	}
	switch x := t.(type) {
	case *ast.IndexExpr:
		t = x.X
	case *ast.IndexListExpr:
		t = x.X
	}
	if id, ok := t.(*ast.Ident); ok {
		return id.Name + "." + d.Name.Name
	}
	return "?." + d.Name.Name
}

// variant is one mutant's version of one function.
type variant struct {
	mutant string
	n      int    // its suffix: F_mutantN
	text   string // the declaration, renamed
}

func schema(path string, orig []byte, ms []mutant, id string) (*result, error) {
	o, err := parse(path, orig)
	if err != nil {
		return nil, err
	}
	res := &result{src: orig, refused: map[string]string{}}
	variants := map[string][]variant{}      // function key -> mutants' versions
	constVariants := map[string][]variant{} // constant -> mutants' values
	n := 0
	for _, m := range ms {
		if !regexp.MustCompile(`^[A-Za-z0-9_./-]+$`).MatchString(m.name) {
			res.refused[m.name] = "its name is not a plain word"
			continue
		}
		mp, err := parse(path, m.src)
		if err != nil {
			res.refused[m.name] = "does not parse: " + err.Error()
			continue
		}
		if !slices.Equal(o.other, mp.other) {
			res.refused[m.name] = "changes a declaration other than a function or a string constant (or the imports)"
			continue
		}
		var changed []string
		why := ""
		for k, fd := range mp.funcs {
			od, ok := o.funcs[k]
			if !ok {
				why = "adds or renames a function"
				break
			}
			if o.text(od) == mp.text(fd) {
				continue
			}
			switch {
			case strings.Contains(k, "#"), od.Name.Name == "init":
				why = "changes an init function or one of two of a name"
			case od.Body == nil:
				why = "changes a function without a body"
			case mp.text(fd.Type) != o.text(od.Type) || recvText(mp, fd) != recvText(o, od):
				why = "changes a function's signature"
			}
			changed = append(changed, k)
		}
		if why == "" && len(mp.funcs) != len(o.funcs) {
			why = "adds or removes a function"
		}
		var changedConsts []string
		for k, v := range mp.consts {
			ov, ok := o.consts[k]
			if !ok {
				why = "adds a constant"
				break
			}
			if o.text(ov) == mp.text(v) {
				continue
			}
			if (v.Type == nil) != (ov.Type == nil) || v.Type != nil && mp.text(v.Type) != o.text(ov.Type) {
				why = "changes a constant's type"
			}
			changedConsts = append(changedConsts, k)
		}
		if why == "" && len(changed)+len(changedConsts) == 0 {
			why = "changes no function"
		}
		if why != "" {
			res.refused[m.name] = why
			continue
		}
		slices.Sort(changed)
		for _, k := range changed {
			n++
			fd := mp.funcs[k]
			t := string(mp.src[mp.off(fd.Pos()):mp.off(fd.Name.Pos())]) +
				fmt.Sprintf("%s_mutant%d", fd.Name.Name, n) +
				string(mp.src[mp.off(fd.Name.End()):mp.off(fd.End())])
			variants[k] = append(variants[k], variant{mutant: m.name, n: n, text: t})
		}
		slices.Sort(changedConsts)
		for _, k := range changedConsts {
			constVariants[k] = append(constVariants[k], variant{mutant: m.name, text: mp.text(mp.consts[k].Values[0])})
		}
	}
	if len(variants)+len(constVariants) == 0 {
		return res, nil
	}

	// ORIG with the changed functions renamed, and the import of os on
	// the package clause's line (no line moves).
	type edit struct {
		at, end int
		s       string
	}
	edits := []edit{{at: o.off(o.file.Name.End()), end: o.off(o.file.Name.End()), s: `; import sqllockmutantos "os"`}}
	keys := make([]string, 0, len(variants))
	for k := range variants {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		fd := o.funcs[k]
		edits = append(edits, edit{at: o.off(fd.Name.Pos()), end: o.off(fd.Name.End()), s: fd.Name.Name + "_mutant0"})
	}
	ckeys := make([]string, 0, len(constVariants))
	for k := range constVariants {
		ckeys = append(ckeys, k)
	}
	slices.Sort(ckeys)
	for _, k := range ckeys {
		id := o.consts[k].Names[0]
		edits = append(edits, edit{at: o.off(id.Pos()), end: o.off(id.End()), s: id.Name + "_mutant0"})
	}
	slices.SortFunc(edits, func(a, b edit) int { return a.at - b.at })
	var b bytes.Buffer
	last := 0
	for _, e := range edits {
		b.Write(orig[last:e.at])
		b.WriteString(e.s)
		last = e.end
	}
	b.Write(orig[last:])

	sel := "sqllockMutant_" + id
	var names []string
	for _, m := range ms {
		if _, ok := res.refused[m.name]; !ok {
			names = append(names, fmt.Sprintf("%q", m.name))
		}
	}
	fmt.Fprintf(&b, "\n\n// The mutants of this file (see internal/mutantschema).\n"+
		"var %s = func() string {\n"+
		"\tv := sqllockmutantos.Getenv(\"SQLLOCK_MUTANT_GO\")\n"+
		"\tswitch v {\n"+
		"\tcase %s:\n"+
		"\t\tif p := sqllockmutantos.Getenv(\"SQLLOCK_MUTANT_GO_REPORT\"); p != \"\" {\n"+
		"\t\t\tif f, err := sqllockmutantos.OpenFile(p, sqllockmutantos.O_APPEND|sqllockmutantos.O_CREATE|sqllockmutantos.O_WRONLY, 0o666); err == nil {\n"+
		"\t\t\t\t_, _ = f.WriteString(\"planted \" + v + \"\\n\")\n"+
		"\t\t\t\t_ = f.Close()\n"+
		"\t\t\t}\n"+
		"\t\t}\n"+
		"\t\treturn v\n"+
		"\t}\n"+
		"\treturn \"\"\n"+
		"}()\n", sel, strings.Join(names, ", "))
	for _, k := range keys {
		for _, v := range variants[k] {
			b.WriteString("\n" + v.text + "\n")
		}
		b.WriteString("\n" + dispatcher(o, o.funcs[k], variants[k], sel) + "\n")
	}
	for _, k := range ckeys {
		typ := "string"
		if t := o.consts[k].Type; t != nil {
			typ = o.text(t)
		}
		fmt.Fprintf(&b, "\nvar %s = func() %s {\n\tswitch %s {\n", k, typ, sel)
		for _, v := range constVariants[k] {
			fmt.Fprintf(&b, "\tcase %q:\n\t\treturn %s\n", v.mutant, v.text)
		}
		fmt.Fprintf(&b, "\t}\n\treturn %s_mutant0\n}()\n", k)
	}
	res.src = b.Bytes()
	return res, nil
}

func recvText(p *parsed, d *ast.FuncDecl) string {
	if d.Recv == nil {
		return ""
	}
	return p.text(d.Recv)
}

// dispatcher is a function with fd's name and signature that calls the
// version the selector names.
func dispatcher(o *parsed, fd *ast.FuncDecl, vs []variant, sel string) string {
	var b strings.Builder
	b.WriteString("func ")
	call := fd.Name.Name
	if fd.Recv != nil {
		r := fd.Recv.List[0]
		name := "sqllockRecv"
		if len(r.Names) == 1 && r.Names[0].Name != "_" {
			name = r.Names[0].Name
		}
		fmt.Fprintf(&b, "(%s %s) ", name, o.text(r.Type))
		call = name + "." + call
	}
	b.WriteString(fd.Name.Name)
	targs := ""
	if tp := fd.Type.TypeParams; tp != nil {
		b.WriteString(o.text(tp))
		var ns []string
		for _, f := range tp.List {
			for _, n := range f.Names {
				ns = append(ns, n.Name)
			}
		}
		targs = "[" + strings.Join(ns, ", ") + "]"
	}
	var params, args []string
	i := 0
	for _, f := range fd.Type.Params.List {
		names := f.Names
		if len(names) == 0 {
			names = []*ast.Ident{{Name: "_"}}
		}
		for _, n := range names {
			pn := n.Name
			if pn == "_" {
				pn = fmt.Sprintf("sqllockP%d", i)
			}
			i++
			params = append(params, pn+" "+o.text(f.Type))
			if _, ok := f.Type.(*ast.Ellipsis); ok {
				pn += "..."
			}
			args = append(args, pn)
		}
	}
	fmt.Fprintf(&b, "(%s)", strings.Join(params, ", "))
	ret := "return "
	if r := fd.Type.Results; r != nil && len(r.List) > 0 {
		b.WriteString(" " + o.text(r))
	} else {
		ret = ""
	}
	a := targs + "(" + strings.Join(args, ", ") + ")"
	fmt.Fprintf(&b, " {\n\tswitch %s {\n", sel)
	for _, v := range vs {
		fmt.Fprintf(&b, "\tcase %q:\n\t\t%s%s_mutant%d%s\n", v.mutant, ret, call, v.n, a)
		if ret == "" {
			b.WriteString("\t\treturn\n")
		}
	}
	fmt.Fprintf(&b, "\t}\n\t%s%s_mutant0%s\n}", ret, call, a)
	return b.String()
}
