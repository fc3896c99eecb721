package postgres

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/outcome"
)

// Every statement renders for every schema version and option, and the
// statements for a version name no column of a later migration (the
// server would refuse them on a table at that version) and no parameter
// the Go side does not bind there.
func TestStatementsPerVersion(t *testing.T) {
	later := map[int][]string{
		2: {"l.waited", "c.waited", "w.waited", "waited =", "$4", "hold_until", "$5", "_floor"}, 3: {"$4", "hold_until", "$5", "_floor"},
		4: {"hold_until", "$5", "_floor"}, 5: {"_floor"},
	}
	for v := 2; v <= latest; v++ {
		for _, notify := range []bool{false, true} {
			for _, durable := range []bool{false, true} {
				s := schema{Table: `"s"."t"`, Version: v, Notify: notify, DurableRelease: durable}
				st := render(s)
				name := fmt.Sprintf("%+v", s)
				require.Equal(t, v, st.version, name)
				for _, q := range []string{st.acquire, st.acquireWait, st.release, st.list} {
					require.NotContains(t, q, "{{", name)
					for _, c := range later[v] {
						require.NotContains(t, q, c, "%s: a statement names %s", name, c)
					}
				}
				require.Equal(t, notify && v >= 3, strings.Contains(st.acquireWait, "mark AS ("), "%s: the waiting form marks", name)
				require.NotContains(t, st.acquire, "mark AS (", "%s: the plain form never marks", name)
				require.Equal(t, notify, strings.Contains(st.release, "pg_notify"), "%s: release notifies", name)
				require.Equal(t, notify, strings.Contains(st.releaseBatch, "pg_notify"), "%s: batch release notifies", name)
				require.Equal(t, !durable, strings.Contains(st.release, "'synchronous_commit', 'off'"), "%s: release commits asynchronously", name)
				require.Equal(t, !durable, strings.Contains(st.releaseBatch, "'synchronous_commit', 'off'"), "%s: batch release commits asynchronously", name)
				require.Equal(t, v >= 3, st.waited, name)
				require.Equal(t, v >= 4, st.value, name)
				require.Equal(t, v >= 5, st.hold, name)
				require.Equal(t, v >= 6, strings.Contains(st.acquire, `"s"."t_floor"`), "%s: a first row takes the floor", name)
				require.Equal(t, v >= 6, strings.Contains(st.acquireAll, `"s"."t_floor"`), "%s: a first row of a set takes the floor", name)
			}
		}
	}
}

// The first statement reads the table's schema version from its columns:
// each migration's table gets the statements for it (00001 and 00002 add
// no column).
func TestSchemaVersionRead(t *testing.T) {
	t.Parallel()
	for v := 1; v <= latest; v++ {
		t.Run(fmt.Sprint(v), func(t *testing.T) {
			t.Parallel()
			db, _ := schemaAt(t, int64(v))
			b, err := New(db.Pool, Options{})
			require.NoError(t, err)
			defer b.Close()
			require.Nil(t, b.stmts.Load(), "New does no I/O")
			st, err := b.statements(testCtx(t), outcome.List, "")
			require.NoError(t, err)
			require.Equal(t, max(v, 2), st.version)
			require.Same(t, st, b.stmts.Load(), "kept for the Backend's life")
			_, err = b.List(testCtx(t), "")
			require.NoError(t, err, "the statements of version %d work on its table", v)
		})
	}
}
