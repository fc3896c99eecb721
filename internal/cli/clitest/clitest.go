// Package clitest is what the script tests of sqllock's builds share:
// the commands their scripts use beyond testscript's own, the "exitto"
// program, and the Params that run cmd/sqllock/testdata/script against a
// database. internal/cli runs the scripts against SQLite, PostgreSQL and
// MariaDB; dialect/etcd/cmd/sqllock against etcd.
package clitest

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"strconv"
	"syscall"
	"time"

	"github.com/rogpeppe/go-internal/testscript"
)

// Params are the testscript parameters of a run of the scripts in dir
// against dialect: its condition ([sqlite], [postgres], [mariadb], [etcd]:
// true only for dialect), the commands below and extra, $HOME in the work
// directory, the mutation check's switches passed on, and setup, which
// points $SQLLOCK_DATABASE_URL at the database. The script's T is in
// Env.Values under ScriptT{}.
func Params(dir, dialect string, setup func(*testscript.Env) error, extra map[string]func(ts *testscript.TestScript, neg bool, args []string)) testscript.Params {
	cmds := map[string]func(ts *testscript.TestScript, neg bool, args []string){
		"exitcode": Exitcode,
		"waitfile": Waitfile,
		"gone":     Gone,
		"sleep":    Sleep,
	}
	for name, f := range extra {
		cmds[name] = f
	}
	return testscript.Params{
		Dir:                 dir,
		RequireExplicitExec: true,
		RequireUniqueNames:  true,
		Setup: func(e *testscript.Env) error {
			e.Setenv("HOME", filepath.Join(e.WorkDir, "home"))
			// The mutation check (.ci/mutants) names the mutant to switch
			// on in these; testscript starts each command with an
			// environment of its own.
			for _, k := range []string{"SQLLOCK_MUTANT_GO", "SQLLOCK_MUTANT_GO_REPORT"} {
				if v, ok := os.LookupEnv(k); ok {
					e.Setenv(k, v)
				}
			}
			e.Values[ScriptT{}] = e.T()
			return setup(e)
		},
		Condition: func(cond string) (bool, error) {
			switch cond {
			case "sqlite", "postgres", "mariadb", "etcd":
				return cond == dialect, nil
			}
			return false, fmt.Errorf("unknown condition %q", cond)
		},
		Cmds: cmds,
	}
}

// ScriptT is the key of the script's testscript.T in Env.Values.
type ScriptT struct{}

// ExittoMain is the "exitto FILE PROGRAM ARGS..." command of the scripts:
// it runs PROGRAM with its stdio, forwards SIGINT and SIGTERM to it, writes
// its exit status (128+N for a death by signal N) to FILE and exits 0. It
// lets a script start sqllock in the background and check its exit status
// later, with testscript's end-of-test interrupt reaching sqllock.
func ExittoMain() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: exitto FILE PROGRAM [ARGS...]")
		os.Exit(2)
	}
	cmd := exec.Command(os.Args[2], os.Args[3:]...)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "exitto:", err)
		os.Exit(2)
	}
	go func() {
		for s := range sigs {
			_ = cmd.Process.Signal(s)
		}
	}()
	_ = cmd.Wait()
	code := cmd.ProcessState.ExitCode()
	if ws, ok := cmd.ProcessState.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
		code = 128 + int(ws.Signal())
	}
	// Written whole, then renamed into place: a script's waitfile returns
	// as soon as FILE exists, and must never read it empty.
	tmp := os.Args[1] + ".exitto"
	if err := os.WriteFile(tmp, fmt.Appendf(nil, "%d\n", code), 0o666); err != nil {
		fmt.Fprintln(os.Stderr, "exitto:", err)
		os.Exit(2)
	}
	if err := os.Rename(tmp, os.Args[1]); err != nil {
		fmt.Fprintln(os.Stderr, "exitto:", err)
		os.Exit(2)
	}
	os.Exit(0)
}

// Exitcode is "exitcode [-within D] [-after D] N program args...": it runs program like
// exec, and requires its exit status to be N (and, with -within, that it
// took at most D; with -after, at least D). stdout and stderr are kept for the next stdout/stderr
// commands.
func Exitcode(ts *testscript.TestScript, neg bool, args []string) {
	within, after := time.Duration(0), time.Duration(0)
	for len(args) >= 2 && (args[0] == "-within" || args[0] == "-after") {
		d, err := time.ParseDuration(args[1])
		if err != nil {
			ts.Fatalf("exitcode: %v", err)
		}
		if args[0] == "-within" {
			within = d
		} else {
			after = d
		}
		args = args[2:]
	}
	if neg || len(args) < 2 {
		ts.Fatalf("usage: exitcode [-within D] [-after D] N program [args...]")
	}
	want, err := strconv.Atoi(args[0])
	if err != nil {
		ts.Fatalf("exitcode: %v", err)
	}
	start := time.Now()
	err = ts.Exec(args[1], args[2:]...)
	if took := time.Since(start); within > 0 && took > within {
		ts.Fatalf("exitcode: %s took %v, more than %v", args[1], took.Round(time.Millisecond), within)
	}
	if took := time.Since(start); took < after {
		ts.Fatalf("exitcode: %s took %v, less than %v", args[1], took.Round(time.Millisecond), after)
	}
	got := 0
	var ee *exec.ExitError
	switch {
	case errors.As(err, &ee):
		got = ee.ExitCode()
	case err != nil:
		ts.Fatalf("exitcode: %v", err)
	}
	if got != want {
		ts.Fatalf("exit status %d, want %d", got, want)
	}
}

// timeoutArg reads the "-timeout D" that may open the arguments of
// command name (default 15s), and returns the rest.
func timeoutArg(ts *testscript.TestScript, name string, args []string) (time.Duration, []string) {
	if len(args) < 2 || args[0] != "-timeout" {
		return 15 * time.Second, args
	}
	d, err := time.ParseDuration(args[1])
	if err != nil {
		ts.Fatalf("%s: %v", name, err)
	}
	return d, args[2:]
}

// Waitfile is "waitfile [-timeout D] [-unless FILE2 REGEXP2] file [regexp]": it waits until
// file exists (and its content matches regexp), polling; fails after the
// timeout (default 15s), and with -unless as soon as FILE2's content
// matches REGEXP2 (a state the script would fail on later anyway, seen
// without waiting out the timeout).
func Waitfile(ts *testscript.TestScript, neg bool, args []string) {
	timeout, args := timeoutArg(ts, "waitfile", args)
	var unless string
	var unlessRe *regexp.Regexp
	if len(args) >= 3 && args[0] == "-unless" {
		unless, unlessRe = ts.MkAbs(args[1]), regexp.MustCompile(args[2])
		args = args[3:]
	}
	if neg || len(args) < 1 || len(args) > 2 {
		ts.Fatalf("usage: waitfile [-timeout D] [-unless file regexp] file [regexp]")
	}
	var re *regexp.Regexp
	if len(args) == 2 {
		re = regexp.MustCompile(args[1])
	}
	name := ts.MkAbs(args[0])
	deadline := time.Now().Add(timeout)
	for {
		data, err := os.ReadFile(name)
		if err == nil && (re == nil || re.Match(data)) {
			return
		}
		if unlessRe != nil {
			if u, err := os.ReadFile(unless); err == nil && unlessRe.Match(u) {
				ts.Fatalf("waitfile: %s matches %v before %s appeared (or matched %v); content %q", unless, unlessRe, name, re, u)
			}
		}
		if time.Now().After(deadline) {
			ts.Fatalf("waitfile: %s did not appear (or match %v) within %v; content %q", args[0], re, timeout, data)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Gone is "gone [-timeout D] pidfile": waits until the process whose pid the file
// holds no longer exists (or is a zombie of another parent).
func Gone(ts *testscript.TestScript, neg bool, args []string) {
	timeout, args := timeoutArg(ts, "gone", args)
	if neg || len(args) != 1 {
		ts.Fatalf("usage: gone [-timeout D] pidfile")
	}
	pid, err := strconv.Atoi(string(regexp.MustCompile(`\d+`).Find([]byte(ts.ReadFile(args[0])))))
	if err != nil {
		ts.Fatalf("gone: %v", err)
	}
	deadline := time.Now().Add(timeout)
	for alive(pid) {
		if time.Now().After(deadline) {
			ts.Fatalf("gone: process %d still runs after %v", pid, timeout)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// alive reports whether pid runs (a zombie counts as gone).
func alive(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	m := regexp.MustCompile(`\) (\S)`).FindSubmatch(stat)
	return m == nil || string(m[1]) != "Z"
}

// Sleep is "sleep D": it waits for the duration D.
func Sleep(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) != 1 {
		ts.Fatalf("usage: sleep duration")
	}
	d, err := time.ParseDuration(args[0])
	ts.Check(err)
	time.Sleep(d)
}
