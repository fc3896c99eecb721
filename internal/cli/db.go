package cli

import (
	"cmp"
	"errors"
	"fmt"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"time"

	"github.com/go-sql-driver/mysql"
	"github.com/jackc/pgx/v5/pgxpool"

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
	my      *mysql.Config // MariaDB
	ext     *Dialect      // a service a Dialect opens
	raw     string        // its URL, as given: only ever passed to ext
	// extTimeout is --connect-timeout for ext (0: the default).
	extTimeout time.Duration
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
	if f.connectTimeout > 0 {
		switch {
		case d.pg != nil:
			d.pg.ConnConfig.ConnectTimeout = f.connectTimeout
		case d.my != nil:
			d.my.Timeout = f.connectTimeout
		case d.ext != nil:
			d.extTimeout = f.connectTimeout
		}
	}
	return d, nil
}

// connectTimeout bounds connecting to a server, and each statement of the
// commands that send a few; 0 for SQLite, which bounds its own waits.
func (d *database) connectTimeout() time.Duration {
	switch {
	case d.pg != nil:
		return d.pg.ConnConfig.ConnectTimeout
	case d.my != nil:
		return d.my.Timeout
	case d.ext != nil:
		return cmp.Or(d.extTimeout, defaultConnectTimeout)
	}
	return 0
}

// resolveDatabase picks the database by precedence: the flag, then
// $SQLLOCK_DATABASE_URL, then the embedded SQLite default. It does no I/O
// (except reading libpq's password file, as pgx does).
//
// The forms accepted, and nothing else:
//
//	postgres://... or postgresql://...   PostgreSQL URL
//	mariadb://... or mysql://...         MariaDB URL (parseMariaDB)
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
	if ext := e.dialectOf(scheme); hasScheme && ext != nil {
		return parseDialect(ext, raw)
	}
	switch {
	case scheme == "postgres" || scheme == "postgresql":
		raw = scheme + raw[len(scheme):] // pgx wants the scheme in lower case
		return parsePostgres(raw, "URL")
	case scheme == "mariadb" || scheme == "mysql":
		return parseMariaDB(scheme + raw[len(scheme):])
	case scheme == "sqlite":
		rest = strings.TrimPrefix(rest, "//") // sqlite:///abs/path and sqlite://rel/path
		if rest == "" {
			return nil, fail(ExitConfig, "%q names no file: want sqlite:PATH", raw)
		}
		return &database{dialect: migrations.SQLite, path: rest, display: "sqlite:" + rest}, nil
	case hasScheme:
		return nil, fail(ExitConfig, "unsupported database URL scheme %q in %s: want postgres://, postgresql://, host=... (keyword/value), mariadb://, mysql://%s, sqlite:PATH or a file path", scheme, maskConnString(raw), e.dialectSchemes())
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
