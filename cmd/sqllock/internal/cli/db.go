package cli

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"
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
// --connect-timeout, the URL (connect_timeout) nor PGCONNECT_TIMEOUT sets one.
const defaultConnectTimeout = 5 * time.Second

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
	d, err := e.resolveDatabase(f.url)
	if err != nil {
		return nil, err
	}
	if d.pg != nil && f.connectTimeout > 0 {
		d.pg.ConnConfig.ConnectTimeout = f.connectTimeout
	}
	return d, nil
}

// resolveDatabase picks the database by precedence: the flag, then
// $SQLLOCK_DATABASE_URL, then the embedded SQLite default. It does no I/O
// (except reading libpq's password file, as pgx does).
//
// The forms accepted, and nothing else:
//
//	postgres://... or postgresql://...   PostgreSQL URL
//	host=... dbname=... user=...         PostgreSQL keyword/value string
//	sqlite:PATH                          SQLite file
//	a path with a "/" or ending in .db, .sqlite, .sqlite3 or .db3,
//	and without "="                      SQLite file
//
// Anything else (a bare word such as "locks", a string with "=" that names
// no connection keyword) is refused as ambiguous, with how to write it: a
// connection string must never silently become a SQLite file of that name,
// where a lock would exclude nobody on another host.
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
		return parsePostgres(raw, "URL")
	case scheme == "sqlite":
		rest = strings.TrimPrefix(rest, "//") // sqlite:///abs/path and sqlite://rel/path
		if rest == "" {
			return nil, fail(ExitConfig, "%q names no file: want sqlite:PATH", raw)
		}
		return &database{dialect: migrations.SQLite, path: rest, display: "sqlite:" + rest}, nil
	case hasScheme:
		return nil, fail(ExitConfig, "unsupported database URL scheme %q in %s: want postgres://, postgresql://, host=... (keyword/value), sqlite:PATH or a file path", scheme, maskConnString(raw))
	case strings.Contains(raw, "="):
		if !hasConnKeyword(raw) {
			return nil, fail(ExitConfig, "database %q is ambiguous: it has \"=\" but names no PostgreSQL connection keyword (host, port, dbname, user, service); write sqlite:%s for a SQLite file of that name", maskConnString(raw), maskConnString(raw))
		}
		return parsePostgres(raw, "keyword/value string")
	case looksLikePath(raw):
		return &database{dialect: migrations.SQLite, path: raw, display: "sqlite:" + raw}, nil
	}
	m := maskConnString(raw)
	return nil, fail(ExitConfig, "database %q is ambiguous: write sqlite:%s (or ./%s) for a SQLite file, or postgres://... or host=... dbname=... for PostgreSQL", m, m, m)
}

// parsePostgres parses a PostgreSQL URL or keyword/value string; what says
// which, for messages. A string that fails to parse is never echoed with
// the parser's error, which quotes the text it choked on: that text can be
// part of a password whose special characters moved the parser's
// boundaries (an unencoded '@', '/', '?' or '#'). The message shows the
// string masked by mask, and the parser's error on the masked string.
func parsePostgres(raw, what string) (*database, error) {
	display := maskConnString(raw)
	if what == "URL" {
		if err := checkUserinfo(raw); err != nil {
			return nil, fail(ExitConfig, "bad PostgreSQL URL %s: %v", display, err)
		}
	}
	cfg, err := pgxpool.ParseConfig(raw)
	if err != nil {
		why := "the password is not written as the form needs it"
		if what == "URL" {
			why += ": percent-encode it (@ %40, : %3A, / %2F, ? %3F, # %23, % %25, space %20)"
		} else {
			why += ": put it in single quotes, with \\' for a quote and \\\\ for a backslash"
		}
		if _, merr := pgxpool.ParseConfig(display); merr != nil {
			why = redact(merr.Error())
		}
		return nil, fail(ExitConfig, "bad PostgreSQL %s %s: %s", what, display, why)
	}
	if cfg.ConnConfig.ConnectTimeout == 0 {
		cfg.ConnConfig.ConnectTimeout = defaultConnectTimeout
	}
	return &database{dialect: migrations.Postgres, pg: cfg, display: display}, nil
}

// userinfoCharsRE matches user info that every URL parser reads the same
// way (RFC 3986: unreserved, sub-delims, ':' and percent-encodings).
var userinfoCharsRE = regexp.MustCompile(`^(?:[A-Za-z0-9._~!$&'()*+,;=:-]|%[0-9A-Fa-f]{2})*$`)

// checkUserinfo refuses a URL whose user info, read up to the last '@' (as
// the redaction reads it), holds a character that must be percent-encoded:
// a parser stops the authority at the first '/', '?' or '#' instead, and
// then takes part of the password for the host, port, database or a
// parameter, and prints it in its errors. It says what to write instead,
// never what it found.
func checkUserinfo(raw string) error {
	start := strings.Index(raw, "://")
	if start < 0 {
		return nil
	}
	start += len("://")
	at := strings.LastIndex(raw[start:], "@")
	if at < 0 {
		return nil
	}
	if !userinfoCharsRE.MatchString(raw[start : start+at]) {
		return errors.New("the user name or password has a character that must be percent-encoded (@ %40, / %2F, ? %3F, # %23, % %25, space %20; and : %3A in the user name), also an '@' elsewhere in the URL")
	}
	return nil
}

// kvPasswordRE matches the value of password=... (and sslpassword=...) in a
// keyword/value string: quoted (to the closing quote, or the end), or
// unquoted up to the next keyword=, so that an unquoted password with a
// space is masked whole.
var kvPasswordRE = regexp.MustCompile(`(?i)((?:^|\s)(?:ssl)?password\s*=\s*)('(?:[^'\\]|\\.)*'?|.*?)(\s+[a-z_]+\s*=|$)`)

// queryPasswordRE matches the value of password=... (and sslpassword=...)
// in a URL query, up to the next &name= (so that an unencoded '&' or '#'
// in it does not leave its second part shown) or the end.
var queryPasswordRE = regexp.MustCompile(`(?i)([?&](?:ssl)?password=)(.*?)(&[a-z_]+=|$)`)

// maskConnString returns raw, a database URL or keyword/value string as the
// user gave it, with every character that may belong to a password
// replaced: in a URL the password parameters' values, then everything between the user name and the last '@'
// (all the user info if the user name holds a character that must be
// encoded; all that precedes the last '@' when there is no "//"); in a
// keyword/value string the password values. It reads raw alone, never a parser's
// result, so that a malformed string is masked as well as a valid one.
func maskConnString(raw string) string {
	if _, rest, ok := splitScheme(raw); ok {
		prefix := raw[:len(raw)-len(rest)]
		// First the query's password values (which may hold an '@'),
		// then the user info up to the last '@' that remains.
		rest = queryPasswordRE.ReplaceAllString(rest, "${1}xxxxx${3}")
		if at := strings.LastIndex(rest, "@"); at >= 0 {
			userinfo := rest[:at]
			masked := "xxxxx"
			if strings.HasPrefix(userinfo, "//") {
				user, _, hasPassword := strings.Cut(userinfo[2:], ":")
				switch {
				case !userinfoCharsRE.MatchString(user) || strings.Contains(user, ":"):
					masked = "//xxxxx"
				case hasPassword:
					masked = "//" + user + ":xxxxx"
				default:
					masked = "//" + user
				}
			}
			rest = masked + rest[at:]
		}
		return redact(prefix + rest)
	}
	if strings.Contains(raw, "=") {
		return redact(kvPasswordRE.ReplaceAllString(raw, "${1}xxxxx${3}"))
	}
	if at := strings.LastIndex(raw, "@"); at >= 0 {
		return "xxxxx" + raw[at:]
	}
	return raw
}

// connKeywordRE finds the libpq keywords that make a string a connection
// string: without one, "a=b.db" is not PostgreSQL either.
var connKeywordRE = regexp.MustCompile(`(?:^|\s)(?:host|hostaddr|port|dbname|user|service)\s*=`)

func hasConnKeyword(s string) bool { return connKeywordRE.MatchString(s) }

// looksLikePath reports whether s is unmistakably a file path: it has a
// directory separator or a SQLite file extension.
func looksLikePath(s string) bool {
	if strings.ContainsRune(s, '/') || strings.ContainsRune(s, filepath.Separator) {
		return true
	}
	switch strings.ToLower(filepath.Ext(s)) {
	case ".db", ".sqlite", ".sqlite3", ".db3":
		return true
	}
	return false
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

var (
	// userinfoRE matches the password in scheme://user:password@host: from
	// the first ':' after the user name to the last '@' of the URL (a
	// password may hold an unescaped '@').
	userinfoRE = regexp.MustCompile(`(://[^:/?#@\s]*:)\S*@`)
	// passwordRE matches the value of password=... (and sslpassword=...) in
	// a URL query or a keyword/value string, quoted or not.
	passwordRE = regexp.MustCompile(`(?i)(password\s*=\s*)('(?:[^'\\]|\\.)*'|[^&\s]+)`)
)

// redact replaces the password fields of the URLs and keyword/value
// strings in msg with xxxxx: the user-info password and password
// parameters. It touches nothing else: a password is never searched for as
// text (that garbled every message containing its letters).
func redact(msg string) string {
	msg = userinfoRE.ReplaceAllString(msg, "${1}xxxxx@")
	return passwordRE.ReplaceAllString(msg, "${1}xxxxx")
}

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
		b, err := postgres.New(pool, postgres.Options{Schema: f.schema, Table: f.table, DisableNotify: f.noNotify, Logger: e.log})
		if err != nil {
			pool.Close()
			return nil, err
		}
		return &backend{Backend: b, close: func() { _ = b.Close(); pool.Close() }}, nil
	}
}

// openReadOnly opens the lock backend for inspection (list, leader): as
// openBackend does, except that a SQLite file this process cannot write is
// opened read-only (and not migrated) instead of refused, so that it can be
// read. A file it can write is opened, and migrated on first use, as
// always: a lock table not created yet then lists nothing.
func (e *env) openReadOnly(ctx context.Context, d *database, f dbFlags, maxConns int) (*backend, error) {
	if d.dialect != migrations.SQLite || f.schema != "" {
		return e.openBackend(ctx, d, f, maxConns)
	}
	if err := d.prepareSQLite(); err != nil {
		return nil, err
	}
	b, err := sqlite.Open(d.path, sqlite.Options{Table: f.table})
	if errors.Is(err, sqlite.ErrUnusable) {
		if ro, rerr := sqlite.Open(d.path, sqlite.Options{Table: f.table, ReadOnly: true}); rerr == nil {
			return &backend{Backend: ro, close: func() { _ = ro.Close() }}, nil
		}
	}
	if err != nil {
		return nil, e.openError(d, err) // what the read-write open said
	}
	return &backend{Backend: b, close: func() { _ = b.Close() }}, nil
}

// connectPG opens a pool and checks that the server answers, within the
// connect timeout and ctx's deadline, whichever ends first. For run
// --wait (e.waitProgress, ctx's deadline the end of the wait), a server that cannot be reached is tried again
// with backoff until the deadline: the wait is spent waiting for the
// database as well as for the lock. A server that refuses the credentials
// or does not have the database fails at once, as a configuration error.
func (e *env) connectPG(ctx context.Context, d *database, maxConns int) (*pgxpool.Pool, error) {
	_, hasDeadline := ctx.Deadline()
	retry := e.waitProgress && hasDeadline
	start := time.Now()
	var printed time.Time
	for attempt := 1; ; attempt++ {
		pool, err := e.connectPGOnce(ctx, d, maxConns)
		var xe *exitError
		if err == nil || !retry || !errors.As(err, &xe) || xe.code != ExitUnavailable {
			return pool, err
		}
		pause := sqllock.DefaultBackoff(attempt) * 20 // about 0.1s, doubling, up to 5s
		dl, _ := ctx.Deadline()
		if time.Until(dl) <= pause {
			// The wait is over (or will be before the next attempt):
			// what it found, and for how long it tried.
			if wait := time.Until(dl); wait > 0 {
				t := time.NewTimer(wait)
				select {
				case <-ctx.Done():
				case <-t.C:
				}
				t.Stop()
			}
			if ctx.Err() != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded) {
				return nil, ctx.Err() // interrupted
			}
			return nil, fail(ExitUnavailable, "%v; gave up after trying for %v (%d attempts, --wait)", xe.err, time.Since(start).Round(100*time.Millisecond), attempt)
		}
		if attempt == 1 || time.Since(printed) >= progressEvery {
			e.progressf("sqllock %s: %v; trying again until the --wait ends", e.cmdName, xe.err)
			printed = time.Now()
		}
		t := time.NewTimer(pause)
		select {
		case <-ctx.Done():
		case <-t.C:
		}
		t.Stop()
		if ctx.Err() != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return nil, ctx.Err()
		}
	}
}

// connectPGOnce is one attempt of connectPG.
func (e *env) connectPGOnce(ctx context.Context, d *database, maxConns int) (*pgxpool.Pool, error) {
	cfg := d.pg.Copy()
	if maxConns > 0 {
		cfg.MaxConns = int32(maxConns)
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fail(ExitConfig, "PostgreSQL at %s: %v", d.display, err)
	}
	bound, why := cfg.ConnConfig.ConnectTimeout, "the connect timeout"
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < bound {
		bound, why = time.Until(dl), "the command's --wait"
	}
	pctx, cancel := context.WithTimeout(ctx, cfg.ConnConfig.ConnectTimeout)
	defer cancel()
	if err := pool.Ping(pctx); err != nil {
		pool.Close()
		if ctx.Err() != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded) {
			return nil, ctx.Err() // interrupted
		}
		if code, what := refusedConfig(err); code != "" {
			return nil, fail(ExitConfig, "PostgreSQL at %s refused the connection: %s (SQLSTATE %s): %s; waiting will not change that: check the URL, the PG* variables and ~/.pgpass",
				d.display, what, code, connectErrorText(err))
		}
		if pctx.Err() != nil || errors.Is(err, context.DeadlineExceeded) || pgconn.Timeout(err) {
			return nil, fail(ExitUnavailable, "cannot reach PostgreSQL at %s: no answer within %v (%s)",
				d.display, bound.Round(100*time.Millisecond), why)
		}
		return nil, fail(ExitUnavailable, "cannot reach PostgreSQL at %s: %s (check the URL, the PG* variables and that the server is up)", d.display, connectErrorText(err))
	}
	return pool, nil
}

// refusedConfig reports the SQLSTATE and its meaning when the server
// answered a connection with an error that only a change of configuration
// mends: the credentials refused, the database missing.
func refusedConfig(err error) (code, what string) {
	var pe *pgconn.PgError
	if !errors.As(err, &pe) {
		return "", ""
	}
	switch pe.Code {
	case "28P01":
		return pe.Code, "wrong password"
	case "28000":
		return pe.Code, "the user may not connect (pg_hba.conf, or no such role)"
	case "3D000":
		return pe.Code, "the database does not exist"
	}
	return "", ""
}

// connectErrorText is pgx's connect error without its repetitions: pgx
// lists every attempt (with and without TLS, each address), and they often
// fail the same way.
func connectErrorText(err error) string {
	var ce *pgconn.ConnectError
	if !errors.As(err, &ce) {
		return err.Error()
	}
	var parts []string
	seen := map[string]bool{}
	var add func(error)
	add = func(err error) {
		if j, ok := err.(interface{ Unwrap() []error }); ok {
			for _, e := range j.Unwrap() {
				add(e)
			}
			return
		}
		if t := err.Error(); !seen[t] {
			seen[t] = true
			parts = append(parts, t)
		}
	}
	if inner := ce.Unwrap(); inner != nil {
		add(inner)
	}
	return fmt.Sprintf("user=%s database=%s: %s", ce.Config.User, ce.Config.Database, strings.Join(parts, "; "))
}

// opContext bounds one statement of a command that sends a few (list,
// release) by the connect timeout: a server that stopped answering fails
// the command instead of hanging it. SQLite bounds its own waits.
func (d *database) opContext(ctx context.Context) (context.Context, context.CancelFunc) {
	if d.pg == nil {
		return context.WithCancel(ctx)
	}
	return context.WithTimeout(ctx, d.pg.ConnConfig.ConnectTimeout)
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
// says what to do: a missing lock table names the exact migrate command
// (with --table and --schema as given), and a SQLite file that cannot be
// used is a configuration error (waiting would not heal it).
func (d *database) opError(err error, f dbFlags) error {
	switch {
	case errors.Is(err, sqllock.ErrSchemaMissing):
		table := cmp.Or(f.table, migrations.DefaultTable)
		if f.schema != "" {
			table = f.schema + "." + table
		}
		cmd := "sqllock migrate up"
		if f.table != "" {
			cmd += " --table " + f.table
		}
		if f.schema != "" {
			cmd += " --schema " + f.schema
		}
		return fail(ExitConfig, "lock table %s is missing in %s; create it once, run: %s (with the same --database-url)", table, d.display, cmd)
	case errors.Is(err, sqlite.ErrUnusable):
		return fail(ExitConfig, "%s: %v", d.display, err)
	}
	return err
}

// describe is the database as shown in messages.
func (d *database) String() string { return fmt.Sprintf("%s (%s)", d.display, d.dialect) }
