// Command publishcheck packs the repository's published modules into a
// file-system module proxy, as if each were tagged at one version, so that
// .ci/publish-check can resolve them from a fresh module the way a consumer
// would (GOPROXY=file://DIR,...).
//
// Usage:
//
//	publishcheck -out DIR [-version vX.Y.Z] MODULE-DIR...
//
// Each MODULE-DIR (relative to the current directory, the repository root)
// holds a go.mod. The zip of each holds the files git would put in a tagged
// commit (tracked files, and untracked ones that are not ignored, so that a
// change can be checked before it is committed), less what the go command
// leaves out of a module zip: nested modules, vendored packages, irregular
// files. The default version is the one at which the nested modules require
// the first module (the root); every requirement of one published module by
// another must name exactly that version, since they are tagged together.
package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/mod/modfile"
	"golang.org/x/mod/module"
	"golang.org/x/mod/semver"
	"golang.org/x/mod/zip"
)

func main() {
	out := flag.String("out", "", "directory of the file-system module proxy to write (required)")
	version := flag.String("version", "", "the version every module is packed at (default: the one the nested modules require of the root)")
	flag.Parse()
	if *out == "" || flag.NArg() == 0 {
		fmt.Fprintln(os.Stderr, "usage: publishcheck -out DIR [-version vX.Y.Z] MODULE-DIR...")
		os.Exit(2)
	}
	if err := run(*out, *version, flag.Args()); err != nil {
		fmt.Fprintln(os.Stderr, "publishcheck:", err)
		os.Exit(1)
	}
}

type mod struct {
	dir  string
	data []byte
	file *modfile.File
}

func run(out, version string, dirs []string) error {
	var mods []mod
	published := make(map[string]bool)
	for _, dir := range dirs {
		name := filepath.Join(dir, "go.mod")
		data, err := os.ReadFile(name)
		if err != nil {
			return err
		}
		f, err := modfile.Parse(name, data, nil)
		if err != nil {
			return err
		}
		if f.Module == nil {
			return fmt.Errorf("%s: no module line", name)
		}
		mods = append(mods, mod{dir: dir, data: data, file: f})
		published[f.Module.Mod.Path] = true
	}
	if version == "" {
		v, err := requiredRoot(mods)
		if err != nil {
			return err
		}
		version = v
	}
	if module.IsPseudoVersion(version) {
		return fmt.Errorf("version %s is a pseudo-version: no tag makes it, so a consumer cannot fetch it; a release is tagged vX.Y.Z", version)
	}
	if semver.Canonical(version) != version {
		return fmt.Errorf("version %q: a release is tagged at a canonical semantic version, vX.Y.Z", version)
	}
	var bad []string
	for _, m := range mods {
		if err := module.Check(m.file.Module.Mod.Path, version); err != nil {
			return err
		}
		for _, r := range m.file.Require {
			if published[r.Mod.Path] && r.Mod.Version != version {
				bad = append(bad, fmt.Sprintf("%s/go.mod requires %s %s, not %s: the modules are tagged together, so it must name the version being tagged (bump it in the release commit: docs/releasing.md)",
					m.dir, r.Mod.Path, r.Mod.Version, version))
			}
		}
	}
	if len(bad) > 0 {
		return errors.New(strings.Join(bad, "\n"))
	}
	for _, m := range mods {
		if err := pack(out, version, m); err != nil {
			return fmt.Errorf("%s: %w", m.dir, err)
		}
	}
	fmt.Println(version)
	return nil
}

// requiredRoot is the version at which the other modules require the first.
func requiredRoot(mods []mod) (string, error) {
	root := mods[0].file.Module.Mod.Path
	version := ""
	for _, m := range mods[1:] {
		for _, r := range m.file.Require {
			if r.Mod.Path != root {
				continue
			}
			if version != "" && r.Mod.Version != version {
				return "", fmt.Errorf("the nested modules require %s at different versions (%s, %s): they are tagged together", root, version, r.Mod.Version)
			}
			version = r.Mod.Version
		}
	}
	if version == "" {
		return "", fmt.Errorf("no module requires %s: name the version with -version", root)
	}
	return version, nil
}

// pack writes the proxy's files for m at version: @v/list, .info, .mod, .zip.
func pack(out, version string, m mod) error {
	p := m.file.Module.Mod.Path
	esc, err := module.EscapePath(p)
	if err != nil {
		return err
	}
	escv, err := module.EscapeVersion(version)
	if err != nil {
		return err
	}
	dir := filepath.Join(out, filepath.FromSlash(esc), "@v")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "list"), []byte(version+"\n"), 0o644); err != nil {
		return err
	}
	info, err := json.Marshal(struct {
		Version string
		Time    time.Time
	}{version, time.Now().UTC().Truncate(time.Second)})
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, escv+".info"), info, 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, escv+".mod"), m.data, 0o644); err != nil {
		return err
	}
	files, err := gitFiles(m.dir)
	if err != nil {
		return err
	}
	var buf bytes.Buffer
	if err := zip.Create(&buf, module.Version{Path: p, Version: version}, files); err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, escv+".zip"), buf.Bytes(), 0o644)
}

// gitFiles lists the files under dir that a commit of the working tree would
// hold: tracked ones that still exist, and untracked ones git does not ignore.
func gitFiles(dir string) ([]zip.File, error) {
	cmd := exec.Command("git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", ".")
	cmd.Dir = dir
	cmd.Stderr = os.Stderr
	listing, err := cmd.Output()
	if err != nil {
		return nil, fmt.Errorf("git ls-files: %w", err)
	}
	var files []zip.File
	for _, name := range strings.Split(string(listing), "\x00") {
		if name == "" {
			continue
		}
		full := filepath.Join(dir, filepath.FromSlash(name))
		info, err := os.Lstat(full)
		if errors.Is(err, os.ErrNotExist) {
			continue // deleted, not yet committed
		}
		if err != nil {
			return nil, err
		}
		files = append(files, file{name: path.Clean(name), full: full, info: info})
	}
	return files, nil
}

type file struct {
	name, full string
	info       os.FileInfo
}

func (f file) Path() string                 { return f.name }
func (f file) Lstat() (os.FileInfo, error)  { return f.info, nil }
func (f file) Open() (io.ReadCloser, error) { return os.Open(f.full) }
