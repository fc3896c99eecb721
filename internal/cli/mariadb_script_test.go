package cli

import (
	"context"
	"database/sql"
	"strings"
	"time"

	"github.com/rogpeppe/go-internal/testscript"

	"github.com/ashlock/ashlock/internal/testkit/mariatest"
)

// mariauser VAR PASSWORD: creates a MariaDB user with PASSWORD, allowed
// everything on the script's database ($MARIADB_DATABASE on
// $MARIADB_ADDR), and sets $VAR to its name. It is dropped when the script
// ends. Only in TestScriptMariaDB.
func cmdMariaUser(ts *testscript.TestScript, neg bool, args []string) {
	if neg || len(args) != 2 {
		ts.Fatalf("usage: mariauser VAR PASSWORD")
	}
	addr, database := ts.Getenv("MARIADB_ADDR"), ts.Getenv("MARIADB_DATABASE")
	if addr == "" {
		ts.Fatalf("mariauser: no $MARIADB_ADDR (only in TestScriptMariaDB)")
	}
	user := "u" + strings.TrimPrefix(database, "t")
	// Client-side interpolation: CREATE USER takes no placeholder.
	db, err := sql.Open("mysql", mariatest.DSN(addr, "")+"&interpolateParams=true")
	ts.Check(err)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// The database name is mariatest's (t_ and hex digits): no quoting
	// needed beyond the backquotes.
	for _, q := range []struct {
		sql  string
		args []any
	}{
		{"CREATE USER '" + user + "'@'%' IDENTIFIED BY ?", []any{args[1]}},
		{"GRANT ALL ON `" + database + "`.* TO '" + user + "'@'%'", nil},
	} {
		if _, err := db.ExecContext(ctx, q.sql, q.args...); err != nil {
			_ = db.Close()
			ts.Fatalf("mariauser: %v", err)
		}
	}
	ts.Defer(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		_, _ = db.ExecContext(ctx, "DROP USER IF EXISTS '"+user+"'@'%'")
		_ = db.Close()
	})
	ts.Setenv(args[0], user)
}
