package sqlite

import (
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

var update = flag.Bool("update", false, "rewrite testdata/statements.sql from the statements as rendered")

// The statements a Backend sends, as New and Open render them for the
// default table, are
// the text of testdata/statements.sql: a change to a statement, or to how
// the statements are rendered, shows there as a diff of the SQL sent
// (rewrite it with go test -run TestStatementsAsSent -update, and read the
// diff).
func TestStatementsAsSent(t *testing.T) {
	b := newBackend(nil, Options{Table: "sqllock_locks"}, false)
	var got strings.Builder
	files := map[string]bool{"new_tenure.sql": true, "grant.sql": true} // acquire's parts
	for _, s := range []struct{ name, sql string }{
		{"acquire", b.acquireSQL}, {"renew", b.renewSQL}, {"renew_batch", b.renewBatchSQL},
		{"now", b.nowSQL}, {"release", b.releaseSQL}, {"peek", b.peekSQL},
		{"list", b.listSQL}, {"list_from", b.listFromSQL},
		{"permit_acquire", b.permit.acquire}, {"permit_peek", b.permit.peek}, {"permit_create", b.permit.create},
		{"acquire_all", b.acquireAllSQL}, {"release_all", b.releaseAllSQL},
		{"reap_begin", b.reapBeginSQL}, {"reap", b.reapSQL}, {"reap_end", b.reapEndSQL},
		{"acquire_mark", b.acquireMarkSQL},
		{"shared_acquire", b.shared.acquire}, {"shared_renew", b.shared.renew}, {"shared_release", b.shared.release},
	} {
		require.NotContains(t, s.sql, "{{", "%s: a hole left unfilled", s.name)
		got.WriteString("-- " + s.name + "\n" + s.sql + "\n\n")
		files[s.name+".sql"] = true
	}
	for _, f := range queryTemplates.Templates() {
		if strings.HasSuffix(f.Name(), ".sql") {
			require.True(t, files[f.Name()], "queries/%s is not a statement a Backend renders", f.Name())
		}
	}
	golden := filepath.Join("testdata", "statements.sql")
	if *update {
		require.NoError(t, os.WriteFile(golden, []byte(got.String()), 0o644))
	}
	want, err := os.ReadFile(golden)
	require.NoError(t, err)
	require.Equal(t, string(want), got.String(), "the statements sent differ from %s", golden)
}
