package cli

import (
	"cmp"
	"context"
	"database/sql"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/go-sql-driver/mysql"

	"github.com/ashlock/ashlock/dialect/mariadb"
	"github.com/ashlock/ashlock/migrations"
)

// mariaDBPort is the port of a MariaDB URL that names none.
const mariaDBPort = "3306"

// mariaDBForm is what a MariaDB URL looks like, for messages.
const mariaDBForm = "mariadb://USER@HOST[:PORT]/DATABASE[?PARAM=VALUE&...] (or mysql://), the password as USER:PASSWORD, percent-encoded"

// parseMariaDB parses a mariadb:// or mysql:// URL (the scheme already
// lowered):
//
//	mariadb://user:password@host[:port]/database?param=value&...
//
// The user info is percent-encoded as in any URL; the query holds the
// driver's DSN parameters (timeout, tls, ...) and session variables, plus
// socket=PATH for a Unix socket instead of host:port. The sessions get
// READ COMMITTED unless the query sets tx_isolation or
// transaction_isolation, the backend's default lock wait unless it sets
// innodb_lock_wait_timeout, and the connect timeout is --connect-timeout,
// else the query's timeout, else 5s. As with PostgreSQL, no parser's error
// about the raw URL is ever shown: they quote the text, which may hold the
// password.
func parseMariaDB(raw string) (*database, error) {
	display := maskConnString(raw)
	bad := func(why string) error {
		return fail(ExitConfig, "bad MariaDB URL %s: %s; want %s", display, why, mariaDBForm)
	}
	if err := checkUserinfo(raw); err != nil {
		return nil, bad(err.Error())
	}
	u, err := url.Parse(raw)
	if err != nil {
		why := "it does not parse as a URL"
		if _, merr := url.Parse(display); merr != nil {
			why = redact(merr.Error())
		}
		return nil, bad(why)
	}
	switch {
	case u.Opaque != "":
		return nil, bad("it has no //")
	case u.User == nil || u.User.Username() == "":
		return nil, bad("it names no user")
	case u.Fragment != "" || strings.HasSuffix(raw, "#"):
		return nil, bad("it has a #fragment")
	}
	dbName := strings.TrimPrefix(u.Path, "/")
	if dbName == "" || strings.Contains(dbName, "/") {
		return nil, bad("it names no database, or more than one path segment")
	}
	q := u.Query()
	for _, p := range []string{"password", "passwd", "user"} {
		if q.Has(p) {
			return nil, bad(fmt.Sprintf("give the %s in the user info (user:password@host), not as a parameter", p))
		}
	}
	socket := q.Get("socket")
	q.Del("socket")
	cfg, err := mysql.ParseDSN("/?" + q.Encode())
	if err != nil {
		return nil, bad(redact(err.Error()))
	}
	cfg.User = u.User.Username()
	cfg.Passwd, _ = u.User.Password()
	cfg.DBName = dbName
	switch {
	case socket != "" && u.Host != "":
		return nil, bad("it names both a host and a socket")
	case socket != "":
		cfg.Net, cfg.Addr = "unix", socket
	default:
		host, port := u.Hostname(), u.Port()
		if host == "" {
			host = "localhost"
		}
		cfg.Net, cfg.Addr = "tcp", net.JoinHostPort(host, cmp.Or(port, mariaDBPort))
	}
	if cfg.Params == nil {
		cfg.Params = map[string]string{}
	}
	// The backend's lock wait for every session, so that its statements
	// need no SET STATEMENT prefix (dialect/mariadb's Options.LockWait).
	if _, ok := cfg.Params["innodb_lock_wait_timeout"]; !ok {
		cfg.Params["innodb_lock_wait_timeout"] = strconv.Itoa(int(mariadb.DefaultLockWait / time.Second))
	}
	if _, ok := cfg.Params["transaction_isolation"]; !ok {
		if _, ok := cfg.Params["tx_isolation"]; !ok {
			cfg.Params["tx_isolation"] = "'READ-COMMITTED'"
		}
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = defaultConnectTimeout
	}
	return &database{dialect: migrations.MariaDB, my: cfg, display: display}, nil
}

// driverLog is the driver's log of what it cannot return (a broken idle
// connection, an auth plugin it fell back from): records at debug level
// when logging was asked for, else nothing, so that no "[mysql]" line
// lands in the middle of a command's output.
type driverLog struct{ log *slog.Logger }

func (l driverLog) Print(v ...any) {
	if l.log != nil {
		l.log.Debug("mysql driver: " + redact(strings.TrimSpace(fmt.Sprint(v...))))
	}
}

// connectMariaDB opens a handle on d and checks that the server answers,
// trying again until a --wait ends as connectPG does.
func (e *env) connectMariaDB(ctx context.Context, d *database, maxConns int, parseTime bool) (*sql.DB, error) {
	var db *sql.DB
	err := e.connecting(ctx, func() (err error) {
		db, err = e.connectMariaDBOnce(ctx, d, maxConns, parseTime)
		return err
	})
	return db, err
}

// connectMariaDBOnce is one attempt of connectMariaDB.
func (e *env) connectMariaDBOnce(ctx context.Context, d *database, maxConns int, parseTime bool) (*sql.DB, error) {
	cfg := d.my.Clone()
	cfg.ParseTime = parseTime // migrations.Status reads goose's time.Time
	cfg.Logger = driverLog{e.log}
	conn, err := mysql.NewConnector(cfg)
	if err != nil {
		return nil, fail(ExitConfig, "MariaDB at %s: %s", d.display, redact(err.Error()))
	}
	db := sql.OpenDB(conn)
	if maxConns > 0 {
		db.SetMaxOpenConns(maxConns)
	}
	bound, why := cfg.Timeout, "the connect timeout"
	if dl, ok := ctx.Deadline(); ok && time.Until(dl) < bound {
		bound, why = time.Until(dl), "the command's --wait"
	}
	pctx, cancel := context.WithTimeout(ctx, cfg.Timeout)
	defer cancel()
	err = db.PingContext(pctx)
	if err == nil {
		return db, nil
	}
	_ = db.Close()
	if ctx.Err() != nil && !errors.Is(ctx.Err(), context.DeadlineExceeded) {
		return nil, ctx.Err() // interrupted
	}
	if num, what := refusedMariaDB(err); what != "" {
		return nil, fail(ExitConfig, "MariaDB at %s refused the connection: %s (error %d): %s; waiting will not change that: check the URL",
			d.display, what, num, redact(err.Error()))
	}
	var ne net.Error
	if pctx.Err() != nil || errors.Is(err, context.DeadlineExceeded) || errors.As(err, &ne) && ne.Timeout() {
		return nil, fail(ExitUnavailable, "cannot reach MariaDB at %s: no answer within %v (%s)",
			d.display, bound.Round(100*time.Millisecond), why)
	}
	return nil, fail(ExitUnavailable, "cannot reach MariaDB at %s: user=%s database=%s: %s (check the URL and that the server is up)",
		d.display, cfg.User, cfg.DBName, redact(err.Error()))
}

// refusedMariaDB reports the server's error number and its meaning when it
// answered a connection with an error only a change of configuration
// mends.
func refusedMariaDB(err error) (uint16, string) {
	var me *mysql.MySQLError
	if !errors.As(err, &me) {
		return 0, ""
	}
	switch me.Number {
	case 1045:
		return me.Number, "wrong password, or no such user"
	case 1044:
		return me.Number, "the user may not use the database"
	case 1049:
		return me.Number, "the database does not exist"
	case 1130:
		return me.Number, "the host may not connect"
	}
	return 0, ""
}

// openMariaDB opens the MariaDB backend on a new handle. The lock table
// must exist (`sqllock migrate up`); the server must be MariaDB 10.6 or
// later and flush its log at every commit.
func (e *env) openMariaDB(ctx context.Context, d *database, f dbFlags, maxConns int) (*backend, error) {
	if f.schema != "" {
		return nil, fail(ExitUsage, "--schema is for PostgreSQL; on MariaDB the URL's database holds the lock table")
	}
	db, err := e.connectMariaDB(ctx, d, maxConns, false)
	if err != nil {
		return nil, err
	}
	b, err := mariadb.New(db, mariadb.Options{Table: f.table})
	if err != nil {
		_ = db.Close()
		code := ExitUnavailable
		if errors.Is(err, mariadb.ErrUnsupportedServer) || errors.Is(err, mariadb.ErrNotDurable) {
			code = ExitConfig
		}
		return nil, fail(code, "MariaDB at %s: %s", d.display, redact(err.Error()))
	}
	return &backend{Backend: b, close: func() { _ = b.Close(); _ = db.Close() }}, nil
}
