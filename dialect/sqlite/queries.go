package sqlite

import (
	"embed"
	"strings"
	"text/template"

	"github.com/ashlock/ashlock/internal/sqlident"
)

// The statements are text/templates in queries/, one per file, rendered
// once per Backend (New, Open) with the vocabulary of the migrations'
// templates: .Table is the validated, quoted lock table. Keys, owners,
// tokens, TTLs and values are always bind parameters, never pasted. Why
// each statement has its shape: docs/sqlite-statements.md.
//
//go:embed queries/*.sql
var queryFiles embed.FS

var queryTemplates = template.Must(template.New("").Option("missingkey=error").ParseFS(queryFiles, "queries/*.sql"))

// holes is what the statements are rendered with: the placeholders of
// queries/*.sql, besides {{template "new_tenure" .}} and
// {{template "grant" .}} (queries/new_tenure.sql, queries/grant.sql).
type holes struct {
	Table string // quoted
	// Floor is the quoted table of the token floor (migration 00005): a
	// key's first row takes its floor + 1.
	Floor string
	// Now is the SQL expression of the database clock: [nowMS], but in
	// tests, which step it.
	Now string
	// Mark renders acquire as a waiting writer's (acquire_mark).
	Mark bool
}

// nowMS is SQLite's clock in integer Unix milliseconds. SQLite evaluates
// 'now' once per sqlite3_step, so every use in one statement (SET, WHERE,
// RETURNING) sees the same instant. unixepoch('subsec') is a double with
// millisecond resolution; ROUND makes the ×1000 exact.
const nowMS = `CAST(ROUND(unixepoch('now', 'subsec') * 1000) AS INTEGER)`

// renderQueries renders the statements for the Backend's table with now,
// the SQL expression of the clock ([nowMS]; tests step it). New and Open
// call it once; no operation renders.
func (b *Backend) renderQueries(now string) {
	h := holes{Table: sqlident.QuoteSQLite(b.table), Floor: sqlident.QuoteSQLite(b.table + "_floor"), Now: now}
	b.acquireSQL = fill(queryTemplates, "acquire", h)
	b.renewSQL = fill(queryTemplates, "renew", h)
	b.renewBatchSQL = fill(queryTemplates, "renew_batch", h)
	b.acquireAllSQL = fill(queryTemplates, "acquire_all", h)
	b.releaseAllSQL = fill(queryTemplates, "release_all", h)
	b.nowSQL = fill(queryTemplates, "now", h)
	b.releaseSQL = fill(queryTemplates, "release", h)
	b.peekSQL = fill(queryTemplates, "peek", h)
	b.listSQL = fill(queryTemplates, "list", h)
	b.listFromSQL = fill(queryTemplates, "list_from", h)
	b.permit = renderPermitQueries(h)
	b.reapSQL = fill(queryTemplates, "reap", h)
	b.reapBeginSQL = fill(queryTemplates, "reap_begin", h)
	b.reapEndSQL = fill(queryTemplates, "reap_end", h)
	b.shared = renderSharedQueries(h)
	mh := h
	mh.Mark = true
	b.acquireMarkSQL = fill(queryTemplates, "acquire", mh)
}

// fill renders the statement in the file name.sql of t for h.
func fill(t *template.Template, name string, h holes) string {
	var b strings.Builder
	if err := t.ExecuteTemplate(&b, name+".sql", h); err != nil {
		panic(err) // the templates are the package's own: a test renders each
	}
	return strings.TrimSpace(b.String())
}
