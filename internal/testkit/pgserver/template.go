package pgserver

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"sync"
	"syscall"
)

// A new cluster is a copy of a template cluster that initdb made once for
// these binaries and this user, kept beside the clusters as
// pgtemplate-HASH/data: initdb takes over a second of real time and most
// of a second of CPU, a copy of its output a tenth of that, and the tests
// start a cluster per test binary, per test that restarts its server, and
// per mutant that runs PostgreSQL tests. The copy is the cluster initdb
// would have made (the settings are appended to postgresql.conf after it,
// as before).
//
// The template is made in a directory of its own and renamed into place
// whole, so a test binary sees either none or a complete one, and test
// binaries that race to make it keep the first one renamed.

// initdbArgs are initdb's arguments after -D DIR; a change to them makes a
// new template (they are part of its hash).
var initdbArgs = []string{"--auth=trust", "-U", "postgres",
	"--no-locale", "--encoding=UTF8", "--no-sync", "--no-instructions"}

// templates holds the template directory made or found by this process,
// per path.
var templates sync.Map // path -> *templateOnce

type templateOnce struct {
	once sync.Once
	err  error
}

// initCluster fills s.DataDir (which exists, empty and owned by the
// server's user) with a copy of the template cluster.
func (s *Server) initCluster(parent string) error {
	dir, err := s.templateDir(parent)
	if err != nil {
		return err
	}
	if err := copyCluster(filepath.Join(dir, "data"), s.DataDir, s.cred); err != nil {
		return fmt.Errorf("pgserver: copy the template cluster %s: %w", dir, err)
	}
	return nil
}

// TemplatesEnv, when set, names the directory the templates are kept in,
// in place of the clusters' parent: the mutation check gives each test
// run a temporary directory of its own, removed when it ends, and keeps
// one template for all of them.
const TemplatesEnv = "SQLLOCK_PG_TEMPLATES"

// templateDir returns the template directory for s's binaries and user
// under parent (or $SQLLOCK_PG_TEMPLATES), made with initdb if none is
// there yet.
func (s *Server) templateDir(parent string) (string, error) {
	if d := os.Getenv(TemplatesEnv); d != "" {
		parent = d
	}
	key, err := s.templateKey()
	if err != nil {
		return "", err
	}
	dir := filepath.Join(parent, "pgtemplate-"+key)
	v, _ := templates.LoadOrStore(dir, &templateOnce{})
	t := v.(*templateOnce)
	t.once.Do(func() { t.err = s.makeTemplate(parent, dir) })
	return dir, t.err
}

// templateKey hashes what the template's content depends on: the
// binaries (their directory, and the postgres binary's size and time, which
// an upgrade changes), the user that owns the files, and initdb's
// arguments.
func (s *Server) templateKey() (string, error) {
	fi, err := os.Stat(filepath.Join(s.binDir, "postgres"))
	if err != nil {
		return "", fmt.Errorf("pgserver: %w", err)
	}
	h := sha256.New()
	fmt.Fprintf(h, "%s\x00%d\x00%d\x00", s.binDir, fi.Size(), fi.ModTime().UnixNano())
	if s.cred != nil {
		fmt.Fprintf(h, "%d:%d\x00", s.cred.Uid, s.cred.Gid)
	} else {
		fmt.Fprintf(h, "euid %d\x00", os.Geteuid())
	}
	for _, a := range initdbArgs {
		fmt.Fprintf(h, "%s\x00", a)
	}
	return hex.EncodeToString(h.Sum(nil))[:16], nil
}

// makeTemplate runs initdb into a fresh directory under parent and renames
// it to dir, unless dir is there already (made earlier, or by another
// process meanwhile).
func (s *Server) makeTemplate(parent, dir string) error {
	if _, err := os.Stat(filepath.Join(dir, "data", "PG_VERSION")); err == nil {
		return nil
	}
	tmp, err := os.MkdirTemp(parent, "pgtemplate-new-")
	if err != nil {
		return fmt.Errorf("pgserver: %w", err)
	}
	defer os.RemoveAll(tmp) // empty once renamed
	if err := os.Chmod(tmp, 0o755); err != nil {
		return fmt.Errorf("pgserver: %w", err)
	}
	data := filepath.Join(tmp, "data")
	if err := os.Mkdir(data, 0o700); err != nil {
		return fmt.Errorf("pgserver: %w", err)
	}
	if s.cred != nil {
		if err := os.Chown(data, int(s.cred.Uid), int(s.cred.Gid)); err != nil {
			return fmt.Errorf("pgserver: give %s to the postgres user: %w", data, err)
		}
	}
	initdb := &Server{binDir: s.binDir, cred: s.cred, DataDir: data}
	if out, err := initdb.run("initdb", append([]string{"-D", data}, initdbArgs...)...); err != nil {
		return fmt.Errorf("pgserver: initdb: %w\n%s", err, out)
	}
	if err := os.Rename(tmp, dir); err != nil {
		if _, serr := os.Stat(filepath.Join(dir, "data", "PG_VERSION")); serr == nil {
			return nil // another process renamed its template first
		}
		return fmt.Errorf("pgserver: %w", err)
	}
	return nil
}

// copyCluster copies the directories and regular files under src into the
// existing directory dst, with their modes, owned by cred's user when cred
// is not nil.
func copyCluster(src, dst string, cred *syscall.Credential) error {
	return filepath.WalkDir(src, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(src, path)
		if err != nil {
			return err
		}
		if rel == "." {
			return nil
		}
		target := filepath.Join(dst, rel)
		fi, err := d.Info()
		if err != nil {
			return err
		}
		switch {
		case d.IsDir():
			if err := os.Mkdir(target, fi.Mode().Perm()); err != nil {
				return err
			}
		case fi.Mode().IsRegular():
			if err := copyFile(path, target, fi.Mode().Perm()); err != nil {
				return err
			}
		default:
			return errors.New(strconv.Quote(rel) + " is neither a directory nor a regular file")
		}
		if cred != nil {
			return os.Lchown(target, int(cred.Uid), int(cred.Gid))
		}
		return nil
	})
}

func copyFile(src, dst string, perm fs.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
