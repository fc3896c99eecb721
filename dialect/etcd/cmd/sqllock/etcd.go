package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"unicode/utf8"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"

	"github.com/ashlock/ashlock/dialect/etcd"
	"github.com/ashlock/ashlock/internal/cli"
	"github.com/ashlock/ashlock/sqllock"
)

// etcdDialect is etcd as sqllock's commands open it.
func etcdDialect() cli.Dialect {
	return cli.Dialect{
		Name:    "etcd",
		Schemes: []string{"etcd", "etcds"},
		Usage:   "etcd://HOST:PORT[,HOST:PORT...][/PREFIX]\tetcd v3 (etcds://: TLS); every member's endpoint",
		Parse: func(raw string) (string, error) {
			u, err := parseURL(raw)
			if err != nil {
				return "", err
			}
			return u.display(), nil
		},
		Open: openEtcd,
		PruneNote: "etcd dates the end of a lease by its own lease clock: the first prune with --older-than above 0 " +
			"under a prefix starts that clock and deletes nothing; the later ones delete what ended --older-than ago",
	}
}

// defaultPort is etcd's client port, for a host given without one.
const defaultPort = "2379"

// etcdURL is a parsed etcd:// or etcds:// URL:
//
//	etcd[s]://[USER[:PASSWORD]@]HOST[:PORT][,HOST[:PORT]...][/PREFIX][?PARAM=VALUE&...]
//
// Each HOST is a member's client endpoint (port 2379 by default; an IPv6
// address in brackets); give every member's, so that the backend can keep
// its keep-alive stream on the leader. PREFIX (percent-encoded; a "/" is
// added at its end when missing) is the key prefix of the locks, by
// default etcd.DefaultPrefix. The parameters: max-txn-ops (the cluster's
// --max-txn-ops when below etcd's default of 128) and, with etcds://,
// cacert (the CA bundle to verify the members by; default: the system's),
// cert and key (a client certificate, both or neither).
type etcdURL struct {
	scheme             string
	hosts              []string // host:port, as given with the port added
	username, password string
	hasPassword        bool
	prefix             string
	maxTxnOps          int
	caFile             string
	certFile, keyFile  string
}

// parseURL parses raw without I/O. Its errors never quote the URL: a
// misplaced character of a password could move the parts' boundaries.
func parseURL(raw string) (etcdURL, error) {
	var u etcdURL
	scheme, rest, ok := strings.Cut(raw, "://")
	u.scheme = strings.ToLower(scheme)
	if !ok || (u.scheme != "etcd" && u.scheme != "etcds") {
		return u, errors.New("want etcd://HOST:PORT[,HOST:PORT...][/PREFIX], or etcds:// for TLS")
	}
	if strings.ContainsRune(rest, '#') {
		return u, errors.New("an etcd URL has no fragment: percent-encode '#' (%23) in a password or prefix")
	}
	// The user info is what precedes the last '@', as the command's
	// redaction reads it; a '/' or '?' in it would move where the host,
	// prefix and parameters start, and show a part of the password there.
	if at := strings.LastIndex(rest, "@"); at >= 0 {
		userinfo := rest[:at]
		rest = rest[at+1:]
		if strings.ContainsAny(userinfo, "/?") {
			return u, errors.New("the user name or password has a character that must be percent-encoded (@ %40, : %3A, / %2F, ? %3F, # %23, % %25), also an '@' elsewhere in the URL")
		}
		user, password, hasPassword := strings.Cut(userinfo, ":")
		var err1, err2 error
		u.username, err1 = url.PathUnescape(user)
		u.password, err2 = url.PathUnescape(password)
		if err1 != nil || err2 != nil {
			return u, errors.New("the user name or password is not percent-encoded as a URL needs (@ %40, : %3A, / %2F, ? %3F, # %23, % %25)")
		}
		if u.username == "" {
			return u, errors.New("a password without a user name: write USER:PASSWORD@")
		}
		u.hasPassword = hasPassword
	}
	rest, query, _ := strings.Cut(rest, "?")
	authority, path, _ := strings.Cut(rest, "/")
	if authority == "" {
		return u, errors.New("no host: want etcd://HOST:PORT[,HOST:PORT...]")
	}
	for i, h := range strings.Split(authority, ",") {
		hp, err := hostPort(h)
		if err != nil {
			// Not quoted: without its '@', user:password reads as a host.
			return u, fmt.Errorf("host %d of the URL: %v", i+1, err)
		}
		u.hosts = append(u.hosts, hp)
	}
	prefix, err := url.PathUnescape(path)
	if err != nil {
		return u, errors.New("the prefix is not percent-encoded as a URL path needs")
	}
	if prefix == "" {
		prefix = etcd.DefaultPrefix
	} else if !strings.HasSuffix(prefix, "/") {
		prefix += "/"
	}
	if err := checkPrefix(prefix); err != nil {
		return u, fmt.Errorf("prefix: %v", err)
	}
	u.prefix = prefix
	params, err := url.ParseQuery(query)
	if err != nil {
		return u, errors.New("the parameters are not written as a URL query needs (NAME=VALUE&...)")
	}
	for name, values := range params {
		if len(values) != 1 {
			return u, fmt.Errorf("parameter %s given %d times: give it once", name, len(values))
		}
		v := values[0]
		switch name {
		case "max-txn-ops":
			n, err := strconv.Atoi(v)
			if err != nil || n < 5 {
				return u, fmt.Errorf("max-txn-ops %q: want the cluster's --max-txn-ops, at least 5", v)
			}
			u.maxTxnOps = n
		case "cacert", "cert", "key":
			if u.scheme != "etcds" {
				return u, fmt.Errorf("parameter %s is for TLS: write etcds://", name)
			}
			if v == "" {
				return u, fmt.Errorf("parameter %s names no file", name)
			}
			switch name {
			case "cacert":
				u.caFile = v
			case "cert":
				u.certFile = v
			default:
				u.keyFile = v
			}
		default:
			return u, fmt.Errorf("unknown parameter %q: want max-txn-ops, and with etcds:// cacert, cert and key", name)
		}
	}
	if (u.certFile == "") != (u.keyFile == "") {
		return u, errors.New("a client certificate needs both cert and key")
	}
	return u, nil
}

// hostPort checks one member's HOST[:PORT] and adds the default port.
func hostPort(h string) (string, error) {
	if h == "" {
		return "", errors.New("empty: a host between two commas, or none before one")
	}
	host, port := h, defaultPort
	if strings.HasPrefix(h, "[") || strings.Count(h, ":") == 1 {
		if strings.HasPrefix(h, "[") && strings.HasSuffix(h, "]") {
			host = h[1 : len(h)-1]
		} else {
			var err error
			if host, port, err = net.SplitHostPort(h); err != nil {
				return "", errors.New("want HOST, HOST:PORT or [IPv6]:PORT")
			}
		}
	} else if strings.Contains(h, ":") {
		return "", errors.New("write an IPv6 address in brackets, [ADDRESS]:PORT")
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return "", errors.New("the port must be a number from 1 to 65535")
	}
	if host == "" || strings.ContainsAny(host, "/\\ %") {
		return "", errors.New("want a host name or address")
	}
	return net.JoinHostPort(host, port), nil
}

// checkPrefix refuses what etcd.New refuses, before any I/O.
func checkPrefix(p string) error {
	if len(p) > 256 || !utf8.ValidString(p) || strings.IndexByte(p, 0) >= 0 {
		return errors.New("want valid UTF-8 without NUL, at most 256 bytes")
	}
	return nil
}

// display is the URL as messages show it: never the password.
func (u etcdURL) display() string {
	var b strings.Builder
	b.WriteString(u.scheme + "://")
	if u.username != "" {
		b.WriteString(url.PathEscape(u.username))
		if u.hasPassword {
			b.WriteString(":xxxxx")
		}
		b.WriteString("@")
	}
	b.WriteString(strings.Join(u.hosts, ","))
	b.WriteString("/" + (&url.URL{Path: u.prefix}).EscapedPath())
	var q []string
	if u.maxTxnOps > 0 {
		q = append(q, "max-txn-ops="+strconv.Itoa(u.maxTxnOps))
	}
	for _, p := range [][2]string{{"cacert", u.caFile}, {"cert", u.certFile}, {"key", u.keyFile}} {
		if p[1] != "" {
			q = append(q, p[0]+"="+url.QueryEscape(p[1]))
		}
	}
	if len(q) > 0 {
		b.WriteString("?" + strings.Join(q, "&"))
	}
	return b.String()
}

// endpoints are the hosts as the etcd client wants them.
func (u etcdURL) endpoints() []string {
	proto := "http://"
	if u.scheme == "etcds" {
		proto = "https://"
	}
	eps := make([]string, len(u.hosts))
	for i, h := range u.hosts {
		eps[i] = proto + h
	}
	return eps
}

// tlsConfig is etcds://'s TLS configuration (nil for etcd://).
func (u etcdURL) tlsConfig() (*tls.Config, error) {
	if u.scheme != "etcds" {
		return nil, nil
	}
	cfg := &tls.Config{MinVersion: tls.VersionTLS12}
	if u.caFile != "" {
		pem, err := os.ReadFile(u.caFile)
		if err != nil {
			return nil, fmt.Errorf("cacert: %w", err)
		}
		cfg.RootCAs = x509.NewCertPool()
		if !cfg.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("cacert %s: no PEM certificate in it", u.caFile)
		}
	}
	if u.certFile != "" {
		cert, err := tls.LoadX509KeyPair(u.certFile, u.keyFile)
		if err != nil {
			return nil, fmt.Errorf("cert and key: %w", err)
		}
		cfg.Certificates = []tls.Certificate{cert}
	}
	return cfg, nil
}

// tableSegment checks --table, which names a namespace under the URL's
// prefix on etcd: PREFIX + TABLE + "/".
func tableSegment(table string) (string, error) {
	if table == "" {
		return "", nil
	}
	if strings.ContainsAny(table, "/\x00") || !utf8.ValidString(table) || len(table) > 63 {
		return "", &cli.DialectUsageError{Err: fmt.Errorf("--table %q: on etcd it names a key namespace under the URL's prefix: want at most 63 bytes of UTF-8 without '/' or NUL", table)}
	}
	return table + "/", nil
}

// authRefused are the errors that no retry heals: the credentials or the
// user's rights.
var authRefused = []error{
	rpctypes.ErrAuthFailed, rpctypes.ErrAuthNotEnabled, rpctypes.ErrPermissionDenied,
	rpctypes.ErrUserEmpty, rpctypes.ErrUserNotFound, rpctypes.ErrInvalidAuthToken,
	rpctypes.ErrGRPCAuthFailed, rpctypes.ErrGRPCAuthNotEnabled, rpctypes.ErrGRPCPermissionDenied,
	rpctypes.ErrGRPCUserEmpty, rpctypes.ErrGRPCUserNotFound, rpctypes.ErrGRPCInvalidAuthToken,
}

// connectError classifies a failure to connect: refused credentials or
// rights are a configuration error; anything else is unreachable for now.
func connectError(err error) error {
	for _, r := range authRefused {
		if errors.Is(err, r) {
			return fmt.Errorf("etcd refused the credentials or rights: %s", rpctypes.ErrorDesc(err))
		}
	}
	return fmt.Errorf("%w: %s", sqllock.ErrUnavailable, rpctypes.ErrorDesc(err))
}

// openEtcd connects to the etcd raw names, checks within the connect
// timeout that it answers a read under the prefix, and returns the etcd
// Backend on it.
func openEtcd(ctx context.Context, raw string, o cli.DialectOptions) (sqllock.Backend, func(), error) {
	u, err := parseURL(raw)
	if err != nil {
		return nil, nil, err
	}
	seg, err := tableSegment(o.Table)
	if err != nil {
		return nil, nil, err
	}
	prefix := u.prefix + seg
	if err := checkPrefix(prefix); err != nil {
		return nil, nil, &cli.DialectUsageError{Err: fmt.Errorf("the URL's prefix and --table together: %v", err)}
	}
	tlsCfg, err := u.tlsConfig()
	if err != nil {
		return nil, nil, err
	}
	c, err := clientv3.New(clientv3.Config{
		Endpoints:   u.endpoints(),
		DialTimeout: o.ConnectTimeout,
		Username:    u.username,
		Password:    u.password,
		TLS:         tlsCfg,
		Logger:      zap.NewNop(),
	})
	if err != nil {
		return nil, nil, connectError(err)
	}
	pctx, cancel := context.WithTimeout(ctx, o.ConnectTimeout)
	_, err = c.Get(pctx, prefix, clientv3.WithCountOnly())
	cancel()
	if err != nil {
		_ = c.Close()
		return nil, nil, connectError(err)
	}
	b, err := etcd.New(c, etcd.Options{Prefix: prefix, MaxTxnOps: u.maxTxnOps})
	if err != nil {
		_ = c.Close()
		return nil, nil, err
	}
	return b, func() { _ = c.Close() }, nil
}
