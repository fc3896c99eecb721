package cli

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"net/url"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"github.com/ashlock/ashlock/dialect/postgres"
	"github.com/ashlock/ashlock/dialect/sqlite"
	"github.com/ashlock/ashlock/migrations"
	"github.com/ashlock/ashlock/sqllock"
)

// EnvDatabaseURL names the environment variable read when --database-url is
// not given.
const EnvDatabaseURL = "SQLLOCK_DATABASE_URL"

// defaultConnectTimeout bounds a PostgreSQL connection attempt when neither
// the URL (connect_timeout) nor PGCONNECT_TIMEOUT sets one.
const defaultConnectTimeout = 10 * time.Second

// database is a resolved --database-url: which dialect, where, and how to
// show it without its password.
type database struct {
	dialect migrations.Dialect
	display string // for messages; never contains the password
	path    string // SQLite file
	pg      *pgxpool.Config
	// defaultPath is set when the SQLite file is the embedded default, whose
	// directory is created (0700) on first use.
	defaultPath bool
}

// database validates the flags and resolves the database; see
// resolveDatabase.
func (e *env) database(f dbFlags) (*database, error) {
	if err := f.validate(); err != nil {
		return nil, err
	}
	return e.resolveDatabase(f.url)
}

// resolveDatabase picks the database by precedence: the flag, then
// $SQLLOCK_DATABASE_URL, then the embedded SQLite default. It does no I/O
// (except reading libpq's password file, as pgx does).
func (e *env) resolveDatabase(flagURL string) (*database, error) {
	raw := flagURL
	if raw == "" {
		raw = e.getenv(EnvDatabaseURL)
	}
	if raw == "" {
		p, err := defaultPath(e.getenv)
		if err != nil {
			return nil, fail(ExitConfig, "no --database-url or $%s, and no state directory for the embedded SQLite file: %v", EnvDatabaseURL, err)
		}
		return &database{dialect: migrations.SQLite, path: p, display: "sqlite:" + p, defaultPath: true}, nil
	}
	scheme, rest, hasScheme := splitScheme(raw)
	switch {
	case scheme == "postgres" || scheme == "postgresql":
		raw = scheme + raw[len(scheme):] // pgx wants the scheme in lower case
		e.addSecretsFromURL(raw)
		cfg, err := pgxpool.ParseConfig(raw)
		if err != nil {
			return nil, fail(ExitConfig, "bad PostgreSQL URL %s: %v", displayURL(raw), err)
		}
		if cfg.ConnConfig.Password != "" {
			e.secrets = append(e.secrets, cfg.ConnConfig.Password)
		}
		if cfg.ConnConfig.ConnectTimeout == 0 {
			cfg.ConnConfig.ConnectTimeout = defaultConnectTimeout
		}
		return &database{dialect: migrations.Postgres, pg: cfg, display: displayURL(raw)}, nil
	case scheme == "sqlite":
		rest = strings.TrimPrefix(rest, "//") // sqlite:///abs/path and sqlite://rel/path
		if rest == "" {
			return nil, fail(ExitConfig, "%q names no file: want sqlite:PATH", raw)
		}
		return &database{dialect: migrations.SQLite, path: rest, display: "sqlite:" + rest}, nil
	case hasScheme:
		return nil, fail(ExitConfig, "unsupported database URL scheme %q in %s: want postgres://, postgresql://, sqlite:PATH or a file path", scheme, displayURL(raw))
	}
	return &database{dialect: migrations.SQLite, path: raw, display: "sqlite:" + raw}, nil
}

var schemeRE = regexp.MustCompile(`^([A-Za-z][A-Za-z0-9+.-]*):`)

// splitScheme returns the URL scheme of s, lowercased, and the rest. A
// one-letter "scheme" is a Windows drive letter, not a scheme.
func splitScheme(s string) (scheme, rest string, ok bool) {
	m := schemeRE.FindStringSubmatch(s)
	if m == nil || (len(m[1]) == 1 && runtime.GOOS == "windows") {
		return "", s, false
	}
	return strings.ToLower(m[1]), s[len(m[0]):], true
}

// addSecretsFromURL remembers the passwords in a URL (user info and a
// password parameter) so that no message shows them, even if the URL does
// not parse.
func (e *env) addSecretsFromURL(raw string) {
	if u, err := url.Parse(raw); err == nil {
		if pw, ok := u.User.Password(); ok && pw != "" {
			e.secrets = append(e.secrets, pw)
		}
		if pw := u.Query().Get("password"); pw != "" {
			e.secrets = append(e.secrets, pw)
		}
	}
	if m := userinfoRE.FindStringSubmatch(raw); m != nil && m[2] != "" {
		e.secrets = append(e.secrets, m[2])
	}
	if pw := e.getenv("PGPASSWORD"); pw != "" {
		e.secrets = append(e.secrets, pw)
	}
}

var (
	// userinfoRE matches the password in scheme://user:password@host.
	userinfoRE = regexp.MustCompile(`(://[^:/?#@\s]*:)([^@\s]*)@`)
	// passwordRE matches password=... in a query or keyword/value string.
	passwordRE = regexp.MustCompile(`(?i)(password\s*=\s*)('(?:[^'\\]|\\.)*'|[^&\s]+)`)
)

// redact removes passwords from msg: every known secret (also in its URL
// encodings), any user-info password and any password=... parameter.
func redact(msg string, secrets []string) string {
	for _, s := range secrets {
		if s == "" {
			continue
		}
		for _, v := range []string{s, url.QueryEscape(s), url.PathEscape(s), url.UserPassword("u", s).String()[2:]} {
			if v != "" {
				msg = strings.ReplaceAll(msg, v, "xxxxx")
			}
		}
	}
	msg = userinfoRE.ReplaceAllString(msg, "${1}xxxxx@")
	return passwordRE.ReplaceAllString(msg, "${1}xxxxx")
}

// displayURL returns raw without its password, for messages.
func displayURL(raw string) string { return redact(raw, nil) }

// defaultPath returns the embedded SQLite file's path: $XDG_STATE_HOME/
// sqllock/locks.db, else ~/.local/state/sqllock/locks.db on Unix-like
// systems, ~/Library/Application Support/sqllock/locks.db on macOS and
// %LocalAppData%\sqllock\locks.db on Windows.
func defaultPath(getenv func(string) string) (string, error) {
	if d := getenv("XDG_STATE_HOME"); d != "" && filepath.IsAbs(d) {
		return filepath.Join(d, "sqllock", "locks.db"), nil
	}
	switch runtime.GOOS {
	case "windows":
		if d := getenv("LocalAppData"); d != "" {
			return filepath.Join(d, "sqllock", "locks.db"), nil
		}
		return "", errors.New("%LocalAppData% is not set")
	case "darwin", "ios":
		home := getenv("HOME")
		if home == "" {
			return "", errors.New("$HOME is not set")
		}
		return filepath.Join(home, "Library", "Application Support", "sqllock", "locks.db"), nil
	case "plan9":
		home := getenv("home")
		if home == "" {
			return "", errors.New("$home is not set")
		}
		return filepath.Join(home, "lib", "sqllock", "locks.db"), nil
	}
	home := getenv("HOME")
	if home == "" {
		return "", errors.New("$HOME is not set (set $XDG_STATE_HOME or --database-url)")
	}
	return filepath.Join(home, ".local", "state", "sqllock", "locks.db"), nil
}

func defaultPathForHelp(getenv func(string) string) string {
	p, err := defaultPath(getenv)
	if err != nil {
		return "$XDG_STATE_HOME/sqllock/locks.db"
	}
	return p
}

// prepareSQLite creates the default file's directory (0700), and checks that
// a given file's directory exists, so that SQLite's "unable to open database
// file" comes with its reason.
func (d *database) prepareSQLite() error {
	dir := filepath.Dir(d.path)
	if d.defaultPath {
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return fail(ExitUnavailable, "cannot create the state directory for the embedded SQLite file: %v", err)
		}
		return nil
	}
	if st, err := os.Stat(dir); err != nil || !st.IsDir() {
		return fail(ExitConfig, "cannot open %s: directory %s does not exist (create it, or use another path)", d.display, dir)
	}
	return nil
}

// backend is an open lock backend and what closes it.
type backend struct {
	sqllock.Backend
	close func()
}

// openBackend opens the lock backend. SQLite files are created and migrated
// on first use; PostgreSQL needs `sqllock migrate up` first. maxConns sizes
// the PostgreSQL pool (0: pgx's default).
func (e *env) openBackend(ctx context.Context, d *database, f dbFlags, maxConns int) (*backend, error) {
	switch d.dialect {
	case migrations.SQLite:
		if f.schema != "" {
			return nil, fail(ExitUsage, "--schema is for PostgreSQL; SQLite has no schemas")
		}
		if err := d.prepareSQLite(); err != nil {
			return nil, err
		}
		b, err := sqlite.Open(d.path, sqlite.Options{Table: f.table})
		if err != nil {
			return nil, e.openError(d, err)
		}
		return &backend{Backend: b, close: func() { _ = b.Close() }}, nil
	default:
		pool, err := e.connectPG(ctx, d, maxConns)
		if err != nil {
			return nil, err
		}
		b, err := postgres.New(pool, postgres.Options{Schema: f.schema, Table: f.table})
		if err != nil {
			pool.Close()
			return nil, err
		}
		return &backend{Backend: b, close: func() { _ = b.Close(); pool.Close() }}, nil
	}
}

// connectPG opens a pool and checks that the server answers.
func (e *env) connectPG(ctx context.Context, d *database, maxConns int) (*pgxpool.Pool, error) {
	cfg := d.pg.Copy()
	if maxConns > 0 {
		cfg.MaxConns = int32(maxConns)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fail(ExitConfig, "PostgreSQL at %s: %v", d.display, err)
	}
	pctx, cancel := context.WithTimeout(ctx, cfg.ConnConfig.ConnectTimeout+2*time.Second)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
		return nil, fail(ExitUnavailable, "cannot reach PostgreSQL at %s: %v (check the URL, the PG* variables and that the server is up)", d.display, err)
	}
	return pool, nil
}

// openSQL opens a database/sql handle for the migrations.
func (e *env) openSQL(ctx context.Context, d *database, schema string) (*sql.DB, func(), error) {
	switch d.dialect {
	case migrations.SQLite:
		if schema != "" {
			return nil, nil, fail(ExitUsage, "--schema is for PostgreSQL; SQLite has no schemas")
		}
		if err := d.prepareSQLite(); err != nil {
			return nil, nil, err
		}
		dsn, err := sqlite.DSN(d.path, sqlite.Options{})
		if err != nil {
			return nil, nil, e.openError(d, err)
		}
		db, err := sql.Open("sqlite", dsn)
		if err != nil {
			return nil, nil, e.openError(d, err)
		}
		db.SetMaxOpenConns(1)
		return db, func() { _ = db.Close() }, nil
	default:
		pool, err := e.connectPG(ctx, d, 2)
		if err != nil {
			return nil, nil, err
		}
		db := stdlib.OpenDBFromPool(pool)
		return db, func() { _ = db.Close(); pool.Close() }, nil
	}
}

func (e *env) openError(d *database, err error) error {
	code := ExitUnavailable
	if errors.Is(err, sqlite.ErrInMemory) || errors.Is(err, sqlite.ErrUnusable) {
		code = ExitConfig
	}
	if errors.Is(err, migrations.ErrInvalidIdentifier) {
		code = ExitUsage
	}
	return fail(code, "cannot open %s: %v", d.display, err)
}

// opError turns an error of an operation on the open backend into one that
// names the database where that helps: a SQLite file that cannot be used is
// a configuration error (waiting would not heal it).
func (d *database) opError(err error) error {
	if errors.Is(err, sqlite.ErrUnusable) {
		return fail(ExitConfig, "%s: %v", d.display, err)
	}
	return err
}

// describe is the database as shown in messages.
func (d *database) String() string { return fmt.Sprintf("%s (%s)", d.display, d.dialect) }
