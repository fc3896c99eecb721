package cli

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestNoPasswordFragmentPrinted runs every command that takes a database
// URL with URLs and keyword/value strings whose password is written wrong
// (unencoded special characters, unquoted spaces, a missing host), and
// requires that no three consecutive characters of the password reach
// stderr, however the parser misreads the string. The servers named do not
// exist (port 1 on loopback refuses at once), so each case ends quickly.
func TestNoPasswordFragmentPrinted(t *testing.T) {
	t.Parallel()
	// Passwords of letters that occur in no message, around the character
	// under test.
	const a, b = "qZjVw", "XkYfQ"
	specials := []string{"@", ":", "/", "#", "?", "%", " ", "%zz", "@:/", "/?#@", "'", "\\", "&"}
	var dsns []string
	for _, c := range specials {
		pw := a + c + b
		dsns = append(dsns,
			"postgres://admin:"+pw+"@127.0.0.1:1/x?connect_timeout=2",
			"postgresql://admin:"+pw+"@127.0.0.1:1/x",
			"postgres://admin:"+pw+"@/x?connect_timeout=2", // missing host
			"postgres://admin:"+pw+"@127.0.0.1:1",          // no database
			"postgres://admin:"+pw+"@127.0.0.1:1/x?application_name=a@b",
			"admin:"+pw+"@127.0.0.1:1/x",           // no scheme
			"mongodb://admin:"+pw+"@127.0.0.1:1/x", // another scheme
			"mariadb://admin:"+pw+"@127.0.0.1:1/x",
			"mysql://admin:"+pw+"@127.0.0.1:1/x?timeout=2s",
			"mariadb://admin:"+pw+"@127.0.0.1:1",                 // no database
			"mariadb://admin:"+pw+"@127.0.0.1:1/x?timeout=never", // a bad parameter
			"mariadb://admin@127.0.0.1:1/x?password="+pw,
			"mariadb://admin:"+pw+"@127.0.0.1:1/x?socket=/nonexistent/s.sock",
			"host=127.0.0.1 port=1 user=admin password="+pw+" dbname=x connect_timeout=2",
			"host=127.0.0.1 port=1 user=admin password='"+pw+"' dbname=x connect_timeout=2",
			"host=127.0.0.1 port=1 user=admin dbname=x password="+pw,
			"postgres://admin@127.0.0.1:1/x?password="+pw+"&connect_timeout=2",
		)
		if strings.ContainsAny(c, "@/?# %") {
			// A user name that cannot be one: it may be a password
			// typed without its user.
			dsns = append(dsns, "postgres://"+pw+"@127.0.0.1:1/x")
		}
	}
	commands := [][]string{
		{"run", "--key", "k", "--", "true"},
		{"run", "--key", "k", "--wait", "300ms", "--", "true"},
		{"elect", "--name", "n", "--", "true"},
		{"leader", "--name", "n"},
		{"list"},
		{"release", "--key", "k", "--force"},
		{"migrate", "up"},
		{"migrate", "status"},
		{"migrate", "down", "--force"},
		{"migrate", "sql"},
		{"bench", "--duration", "100ms"},
	}
	for _, dsn := range dsns {
		for _, args := range commands {
			name := fmt.Sprintf("%s/%q", args[0], dsn)
			t.Run(name, func(t *testing.T) {
				t.Parallel()
				tb := setup(t)
				full := append([]string{args[0], "--database-url", dsn}, args[1:]...)
				code, stdout, stderr := tb.run(testCtx(t), full...)
				if !(len(args) == 2 && args[1] == "sql") { // migrate sql needs no connection
					require.NotZero(t, code, "stderr: %s", stderr)
				}
				pw := dsnPassword(dsn)
				for i := 0; i+3 <= len(pw); i++ {
					require.NotContains(t, stderr, pw[i:i+3], "a fragment of the password %q", pw)
					require.NotContains(t, stdout, pw[i:i+3], "a fragment of the password %q", pw)
				}
			})
		}
	}
}

// dsnPassword is the password the test wrote into dsn.
func dsnPassword(dsn string) string {
	i := strings.Index(dsn, "qZjVw")
	j := strings.Index(dsn, "XkYfQ")
	return dsn[i : j+len("XkYfQ")]
}
