package main

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/dialect/etcd"
	"github.com/ashlock/ashlock/dialect/etcd/internal/etcdtest"
	"github.com/ashlock/ashlock/internal/cli"
	"github.com/ashlock/ashlock/internal/testkit/etcdserver"
	"github.com/ashlock/ashlock/sqllock"
)

func TestParseURL(t *testing.T) {
	for _, tc := range []struct {
		raw, display string
		endpoints    []string
		prefix       string
	}{
		{"etcd://h1", "etcd://h1:2379/" + etcd.DefaultPrefix, []string{"http://h1:2379"}, etcd.DefaultPrefix},
		{"ETCD://h1:1,h2:2,[::1]:3/app/locks", "etcd://h1:1,h2:2,[::1]:3/app/locks/",
			[]string{"http://h1:1", "http://h2:2", "http://[::1]:3"}, "app/locks/"},
		{"etcd://[fe80::1]/a%20b/", "etcd://[fe80::1]:2379/a%20b/", []string{"http://[fe80::1]:2379"}, "a b/"},
		{"etcds://u:p%40ss@h1/p?cacert=/ca.pem&max-txn-ops=64", "etcds://u:xxxxx@h1:2379/p/?max-txn-ops=64&cacert=%2Fca.pem",
			[]string{"https://h1:2379"}, "p/"},
		{"etcd://u@h1/", "etcd://u@h1:2379/" + etcd.DefaultPrefix, []string{"http://h1:2379"}, etcd.DefaultPrefix},
	} {
		u, err := parseURL(tc.raw)
		require.NoError(t, err, tc.raw)
		require.Equal(t, tc.display, u.display(), tc.raw)
		require.Equal(t, tc.endpoints, u.endpoints(), tc.raw)
		require.Equal(t, tc.prefix, u.prefix, tc.raw)
	}
	u, err := parseURL("etcds://u:p%40ss@h1/p")
	require.NoError(t, err)
	require.Equal(t, "u", u.username)
	require.Equal(t, "p@ss", u.password)

	// Refused without I/O, and the password never in the message.
	for _, raw := range []string{
		"etcd://", "etcd://s3cret@", "etcd://:s3cret@h1", "etcd://u:s3cret@h1,,h2",
		"etcd://u:s3cret@h1:0", "etcd://u:s3cret@h1:x", "etcd://u:s3cret%zz@h1",
		"etcd://u:s3cret@h1/p%zz", "etcd://u:s3cret@h1/p#s3cret", "etcd://u:s3cret@h1/p?cert=/c",
		"etcds://u:s3cret@h1/p?cert=/c", "etcd://u:s3cret@h1/p?s3cret=1", "etcd://u:s3cret@h1/p?max-txn-ops=1",
		"etcd://u:s3cret@h1/p?max-txn-ops=5&max-txn-ops=6", "etcd://u:s3cret@h1/a\x00b", "etcd://u:s3cret@fe80::1",
		"etcd://u:s3cret@h/" + strings.Repeat("x", 300), "http://u:s3cret@h1",
		// A password with an unencoded '/' or '?', or without its '@'.
		"etcd://u:s3/cret@h1/p", "etcd://u:s3?cret@h1/p", "etcd://u:s3cret", "etcd://h1,u:s3cret",
	} {
		_, err := parseURL(raw)
		require.Error(t, err, raw)
		// Every password here starts "s3": no part of it may show.
		if strings.Contains(err.Error(), "s3") && !strings.Contains(raw, "?s3cret") {
			t.Errorf("%q: the error shows a part of the password: %v", raw, err)
		}
	}
}

// TestRefusedCredentialsExit78 enables authentication on an etcd of its
// own: a wrong password is a configuration error (exit 78, at once, also
// with --wait: retrying never heals it), never shown; the right one works.
func TestRefusedCredentialsExit78(t *testing.T) {
	if _, err := etcdserver.FindBinary(); err != nil {
		etcdtest.Unavailable(t, err.Error())
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cluster, err := etcdserver.Start(ctx, etcdserver.Options{})
	require.NoError(t, err)
	t.Cleanup(cluster.Close)
	c, err := etcdtest.NewClient(cluster.Endpoints())
	require.NoError(t, err)
	defer c.Close()
	_, err = c.RoleAdd(ctx, "root")
	require.NoError(t, err)
	_, err = c.UserAdd(ctx, "root", "right-pw")
	require.NoError(t, err)
	_, err = c.UserGrantRole(ctx, "root", "root")
	require.NoError(t, err)
	_, err = c.AuthEnable(ctx)
	require.NoError(t, err)

	host := strings.TrimPrefix(cluster.Endpoints()[0], "http://")
	run := func(args ...string) (int, string, time.Duration) {
		var out, errs bytes.Buffer
		start := time.Now()
		code := cli.RunWith(ctx, args, strings.NewReader(""), &out, &errs, etcdDialect())
		return code, out.String() + errs.String(), time.Since(start)
	}
	wrong := "etcd://root:wrong-pw@" + host + "/p"
	code, out, _ := run("list", "--database-url", wrong)
	require.Equal(t, 78, code, out)
	require.Contains(t, out, "etcd refused the credentials")
	require.NotContains(t, out, "wrong-pw")
	code, out, took := run("run", "--wait", "30s", "--key", "k", "--database-url", wrong, "--", "true")
	require.Equal(t, 78, code, out)
	require.Less(t, took, 10*time.Second, "refused credentials were tried again")

	_, _, err = openEtcd(ctx, wrong, cli.DialectOptions{ConnectTimeout: 5 * time.Second})
	require.Error(t, err)
	require.False(t, errors.Is(err, sqllock.ErrUnavailable), "%v", err)

	code, out, _ = run("list", "--database-url", "etcd://root:right-pw@"+host+"/p")
	require.Equal(t, 0, code, out)
}
