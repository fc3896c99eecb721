package postgres

import (
	"context"
	"embed"
	"errors"
	"fmt"
	"strings"
	"text/template"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// The statements are text/templates in queries/, one per file, rendered
// once per Backend with the vocabulary of the migrations' templates: .Table
// is the validated, quoted lock table. Keys, owners, tokens, TTLs and
// values are always bind parameters, never pasted. Why each statement has
// its shape (plan-node costs, measurements): docs/postgres-statements.md.
//
//go:embed queries/*.sql
var queryFiles embed.FS

var queryTemplates = template.Must(template.New("").Option("missingkey=error").ParseFS(queryFiles, "queries/*.sql"))

// schema is what the statements are rendered for: the placeholders of
// queries/*.sql, besides {{template "durable"}} (queries/durable.sql).
type schema struct {
	Table string // quoted
	// Version is the lock table's schema version (queries/schema.sql): the
	// statements use the columns of the migrations up to it.
	Version int
	// Notify: the statement takes part in release notifications. A release
	// notifies when a waiter marked its lease; an acquire in its waiting
	// form marks the lease of the holder that refuses it.
	Notify bool
	// DurableRelease: a release commits durably, not asynchronously.
	DurableRelease bool
	// Mark: the acquire is a waiting writer's (sqllock.AcquireRequest.Mark):
	// a refusal marks the key so that new shared grants are refused
	// (from 00007, docs/shared-locks.md).
	Mark bool
}

// Floor is the quoted name of the table's token floor, the sequence of
// migration 00006: the table's quoted name with "_floor" at the end of
// its last part (identifiers are validated, so they hold no quote).
func (s schema) Floor() string {
	return strings.TrimSuffix(s.Table, `"`) + `_floor"`
}

// latest is the schema version of the newest migration whose columns (or,
// for 00006, the token floor) the statements use; a table at an older one
// gets statements without them.
const latest = 7

// statements are a Backend's statements for one schema version. acquire is
// the plain form of the acquire, acquireWait its waiting form (TryAcquire
// sends it while the key is watched); the batch statements need every
// column and are sent only at the latest version. waited, value and hold
// say which columns of migrations 00003, 00004 and 00005 they use, shared
// whether 00007's shared locks are there (acquireMark, acquireMarkWait:
// acquire and acquireWait in a waiting writer's form; sharedAcquire,
// sharedRenew, sharedRelease: shared.go).
type statements struct {
	version                                     int
	acquire, acquireWait, release, list, peek   string
	acquireMark, acquireMarkWait                string
	sharedAcquire, sharedRenew, sharedRelease   string
	sharedAcquireWait                           string // sharedAcquire's waiting form (.Notify)
	renew, renewBatch, fence, channel, schema   string
	acquireBatch, releaseBatch                  string
	acquireAll, acquireAllBatch                 string // multi.go
	reap                                        string // reap.go, from 00006
	waited, value, hold, shared, durableRelease bool
}

// render renders the statements for s.
func render(s schema) *statements {
	plain := s
	plain.Notify = false
	mark, markWait := plain, s
	mark.Mark, markWait.Mark = true, true
	st := &statements{
		version: s.Version,
		acquire: fill("acquire", plain), acquireWait: fill("acquire", s),
		release: fill("release", s), list: fill("list", s), peek: fill("peek", s),
		renew: fill("renew", s), renewBatch: fill("renew_batch", s),
		fence: fill("fence", s), channel: fill("channel", s), schema: fill("schema", s),
		acquireBatch: fill("acquire_batch", plain), releaseBatch: fill("release_batch", s),
		acquireAll: fill("acquire_all", plain), acquireAllBatch: fill("acquire_all_batch", plain),
		reap:   fill("reap", plain),
		waited: s.Version >= 3, value: s.Version >= 4, hold: s.Version >= 5, shared: s.Version >= 7,
		durableRelease: s.DurableRelease,
	}
	if st.shared {
		st.acquireMark, st.acquireMarkWait = fill("acquire", mark), fill("acquire", markWait)
		st.sharedAcquire, st.sharedRenew, st.sharedRelease = fill("shared_acquire", plain), fill("shared_renew", plain), fill("shared_release", s)
		st.sharedAcquireWait = fill("shared_acquire", s)
	} else {
		// No readers to keep out: a waiting writer's request is a plain one.
		st.acquireMark, st.acquireMarkWait = st.acquire, st.acquireWait
	}
	return st
}

// fill renders the statement in queries/name.sql for s.
func fill(name string, s schema) string {
	var b strings.Builder
	if err := queryTemplates.ExecuteTemplate(&b, name+".sql", s); err != nil {
		panic(err) // the templates are the package's own: a test renders each
	}
	return b.String()
}

// statements returns the statements for the lock table's schema version,
// which the first call reads (queries/schema.sql, on a connection where the
// pooler check runs, as for any first statement) and keeps for the
// Backend's life: a Backend built before `sqllock migrate up` keeps the
// statements of the version it found until it is rebuilt. A read that
// fails is not kept: the next call reads again. o and key name the
// operation in its error.
func (b *Backend) statements(ctx context.Context, o outcome.Op, key string) (*statements, error) {
	if st := b.stmts.Load(); st != nil {
		return st, nil
	}
	select {
	case b.schemaSem <- struct{}{}:
		defer func() { <-b.schemaSem }()
	case <-ctx.Done():
		return nil, pg.NotSent(o, key, true, ctx.Err())
	}
	if st := b.stmts.Load(); st != nil {
		return st, nil
	}
	version, err := b.readVersion(ctx)
	if err != nil {
		if _, refused := errors.AsType[*pgconn.PgError](err); !refused && !errors.Is(err, ErrPoolerSettings) {
			// The operation itself was not sent; when the context ended,
			// that is why.
			if ctx.Err() != nil {
				return nil, pg.NotSent(o, key, true, errors.Join(ctx.Err(), err))
			}
			err = notSentError{err}
		}
		return nil, b.translate(ctx, o, key, err)
	}
	st := b.full
	if version < latest {
		s := schema{Table: b.table, Version: version, Notify: b.notify, DurableRelease: b.full.durableRelease}
		st = render(s)
		b.log.Warn("sqllock/postgres: the lock table lacks the columns of migrations after "+fmt.Sprintf("%05d", version)+
			"; acquires that need them (a value from 00004, a minimum hold from 00005) fail, and from before 00003 every release notifies, "+
			"until this Backend is rebuilt after `sqllock migrate up`", "table", b.table, "version", version)
	}
	b.stmts.Store(st)
	return st, nil
}

// readVersion reads the lock table's schema version on a connection of the
// pool, in the round trip of the pooler check when that is due (the first
// statement's), else alone; both in the simple protocol, which prepares
// nothing.
func (b *Backend) readVersion(ctx context.Context) (int, error) {
	if b.db != nil {
		return b.readVersionDB(ctx)
	}
	c, res, err := b.checkedConn(ctx, b.full.schema)
	if err != nil {
		return 0, err
	}
	defer c.Release()
	if res == nil {
		results, err := c.Conn().PgConn().Exec(ctx, b.full.schema).ReadAll()
		if err != nil {
			return 0, err
		}
		res = results[0]
	}
	if res.Err != nil {
		return 0, res.Err
	}
	if len(res.Rows) != 1 || len(res.Rows[0]) != 1 {
		return 0, fmt.Errorf("sqllock/postgres: schema version: unexpected result %q", res.Rows)
	}
	return versionOf(string(res.Rows[0][0]))
}

// lacks is the error of a request that needs a column st does not have
// (needValue: 00004's "value", needHold: 00005's "hold_until"), before
// anything is sent; nil when st has them. A value or a minimum hold is
// never silently dropped.
func (st *statements) lacks(table string, needValue, needHold bool) error {
	switch {
	case needValue && !st.value:
		return fmt.Errorf("%w: table %s lacks the \"value\" column of migration 00004 (run `sqllock migrate up`, then rebuild the Backend)",
			sqllock.ErrSchemaMissing, table)
	case needHold && !st.hold:
		return fmt.Errorf("%w: table %s lacks the \"hold_until\" column of migration 00005, which a minimum hold needs (run `sqllock migrate up`, then rebuild the Backend)",
			sqllock.ErrSchemaMissing, table)
	}
	return nil
}
