package postgres

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/ashlock/ashlock/internal/groupcommit"
	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

var _ sqllock.MultiAcquirer = (*Backend)(nil)

// TryAcquireAll implements [sqllock.MultiAcquirer] in one statement
// (queries/acquire_all.sql), on the pgx pool or the *sql.DB alike: every
// key of the set granted in one transaction and one commit, or none. Its
// rows are locked in key order without waiting (SKIP LOCKED), so two
// overlapping sets never deadlock, and a row another transaction holds
// locked refuses the set with a [*sqllock.HeldError] that has no owner
// (try again). A refusal that the statement's snapshot shows (a key held
// by another owner) locks no row, writes nothing and takes no transaction
// id. When another transaction inserts a fresh key of the set first, the
// statement fails whole and the refusal names that key, without owner.
//
// Outcomes as for [Backend.TryAcquire]: a reply lost in flight is
// [sqllock.ErrIndeterminate], and repeating the request (same Owner)
// returns the same grant. It needs the table at the latest migration
// (00005).
//
// Concurrent sets are coalesced as single acquires are (group commit,
// batch.go), in a queue of their own: while groupCommitInFlight set
// statements are in flight, a set waits, and the queue goes as one
// statement and one commit (queries/acquire_all_batch.sql) of sets that
// share no key, each granted whole or refused whole with the single
// statement's answer. A batch the server refused (a fresh key inserted
// first by another transaction fails it whole) sends each set alone.
func (b *Backend) TryAcquireAll(ctx context.Context, req sqllock.MultiAcquireRequest) ([]sqllock.Lease, error) {
	if err := req.Validate(); err != nil {
		return nil, err
	}
	sorted := sqllock.SortedKeys(req.Keys)
	if err := ctx.Err(); err != nil {
		return nil, pg.NotSent(outcome.Acquire, sorted[0], true, err)
	}
	st, err := b.statements(ctx, outcome.Acquire, sorted[0])
	if err != nil {
		return nil, err
	}
	if !st.hold {
		return nil, fmt.Errorf("%w: table %s lacks the columns of migration 00005, which an acquire of a set of keys needs (run `sqllock migrate up`, then rebuild the Backend)",
			sqllock.ErrSchemaMissing, b.table)
	}
	if b.setQ.Limit == 0 || st.version != latest {
		return b.tryAcquireAll(ctx, req, sorted, st)
	}
	return b.setQ.DoKeys(ctx, sorted, len(sorted), setCall{req, sorted}, func(ctx context.Context) ([]sqllock.Lease, error) {
		return b.tryAcquireAll(ctx, req, sorted, st)
	})
}

// setCall is a TryAcquireAll as its queue carries it: the request and its
// keys sorted.
type setCall struct {
	req    sqllock.MultiAcquireRequest
	sorted []string
}

// tryAcquireAll sends req (its keys sorted) alone.
func (b *Backend) tryAcquireAll(ctx context.Context, req sqllock.MultiAcquireRequest, sorted []string, st *statements) ([]sqllock.Lease, error) {
	keys, err := json.Marshal(sorted)
	if err != nil {
		return nil, err
	}
	rows := make(map[string]acquireAllRow, len(sorted))
	var (
		key string
		r   acquireAllRow
	)
	err = b.queryRowsVia(ctx, sendOpts{pooler: true}, st.acquireAll,
		[]any{string(keys), leaseMicros(req.TTL), req.Owner, nonEmpty(req.Value)},
		[]any{&key, &r.granted, &r.token, &r.deadline, &r.held, &r.owner, &r.now, &r.grantable, &r.unlocked, &r.value, &r.shared}, func() error {
			rows[key] = r
			r.value = nil // scanned fresh for the next row
			return nil
		})
	if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok && pgErr.Code == "23505" {
		// A fresh key of the set was inserted first by another
		// transaction: the statement was rolled back whole.
		return nil, &sqllock.HeldError{Key: insertedKey(err, pgErr, sorted)}
	}
	if err != nil {
		return nil, b.translate(ctx, outcome.Acquire, sorted[0], err)
	}
	return acquiredAll(req, sorted, rows)
}

// setMember is a queued TryAcquireAll.
type setMember = groupcommit.Member[setCall, []sqllock.Lease]

// sendSets sends members (sets that share no key) as one
// acquire_all_batch.sql.
func (b *Backend) sendSets(ctx context.Context, members []*setMember) {
	if !batches(ctx, b, members) {
		return
	}
	n := len(members)
	var keys []string
	var ords []int64
	micros, owners, values := make([]int64, n), make([]string, n), make([][]byte, n)
	rows := make([]map[string]acquireAllRow, n)
	for i, m := range members {
		for _, k := range m.Req.sorted {
			keys, ords = append(keys, k), append(ords, int64(i+1))
		}
		req := m.Req.req
		micros[i], owners[i], values[i] = leaseMicros(req.TTL), req.Owner, nonEmpty(req.Value)
		rows[i] = make(map[string]acquireAllRow, len(m.Req.sorted))
	}
	var (
		ord int64
		key string
		r   acquireAllRow
	)
	err := b.queryRows(ctx, b.full.acquireAllBatch, []any{keys, ords, micros, owners, values},
		[]any{&ord, &key, &r.granted, &r.token, &r.deadline, &r.held, &r.owner, &r.now, &r.grantable, &r.unlocked, &r.value, &r.shared}, func() error {
			if ord < 1 || ord > int64(n) {
				return fmt.Errorf("sqllock/postgres: batch set acquire returned an unknown set %d", ord)
			}
			if _, twice := rows[ord-1][key]; twice || !slices.Contains(members[ord-1].Req.sorted, key) {
				return fmt.Errorf("sqllock/postgres: batch set acquire returned key %q of set %d unknown or twice", key, ord)
			}
			rows[ord-1][key] = r
			r.value = nil // scanned fresh for the next row
			return nil
		})
	if err != nil {
		batchFailed(ctx, b, outcome.Acquire, members, err)
		return
	}
	for i, m := range members {
		m.Res, m.Err = acquiredAll(m.Req.req, m.Req.sorted, rows[i])
	}
}

// acquireAllRow is what queries/acquire_all.sql returns per key.
type acquireAllRow struct {
	acquireRow
	grantable bool // the snapshot's row may be granted (true for a fresh key)
	unlocked  bool // a row of the snapshot that the statement did not lock
}

// acquiredAll is TryAcquireAll's answer to req (keys sorted) from its
// statement's rows.
func acquiredAll(req sqllock.MultiAcquireRequest, sorted []string, rows map[string]acquireAllRow) ([]sqllock.Lease, error) {
	granted := 0
	for _, k := range sorted {
		if r, ok := rows[k]; ok && r.granted {
			granted++
		}
	}
	switch {
	case granted == len(sorted):
		out := make([]sqllock.Lease, len(req.Keys))
		for i, k := range req.Keys {
			r := rows[k]
			out[i] = sqllock.Lease{Key: k, Token: r.token, Owner: req.Owner, Deadline: r.deadline, BackendTime: r.now, Value: nonEmpty(req.Value)}
		}
		return out, nil
	case granted > 0 || len(rows) != len(sorted):
		return nil, fmt.Errorf("sqllock/postgres: TryAcquireAll %q: unexpected answer: %d of %d keys granted, %d rows", req.Keys, granted, len(sorted), len(rows))
	}
	// The first key in key order that the snapshot refuses names the
	// holder; with none, the first that was locked by another
	// transaction (or changed) before this statement could lock it.
	for _, k := range sorted {
		r := rows[k]
		switch {
		case r.grantable:
		case r.held && r.deadline.After(r.now):
			return nil, &sqllock.HeldError{Key: k, Owner: r.owner, Token: r.token, Remaining: r.deadline.Sub(r.now), Value: nonEmpty(r.value), Shared: r.shared}
		case r.token == math.MaxInt64:
			return nil, fmt.Errorf("%w: %q reached token %d", sqllock.ErrTokenExhausted, k, r.token)
		default:
			return nil, &sqllock.HeldError{Key: k}
		}
	}
	for _, k := range sorted {
		if rows[k].unlocked {
			return nil, &sqllock.HeldError{Key: k}
		}
	}
	return nil, &sqllock.HeldError{Key: sorted[0]}
}

// insertedKey is the key a unique violation's detail names ("Key
// (key)=(k) already exists."), when it is one of keys (the server's
// messages may be translated), else the first of keys. lib/pq's error
// carries the detail as its field 'D' (read with its Get method), not in
// the *pgconn.PgError the *sql.DB path reads it as.
func insertedKey(err error, pgErr *pgconn.PgError, keys []string) string {
	d := pgErr.Detail
	if g, ok := errors.AsType[detailed](err); ok && d == "" {
		d = g.Get('D')
	}
	const pre, post = "Key (key)=(", ") already exists."
	if strings.HasPrefix(d, pre) && strings.HasSuffix(d, post) {
		if k := d[len(pre) : len(d)-len(post)]; slices.Contains(keys, k) {
			return k
		}
	}
	return keys[0]
}

// detailed is lib/pq's *pq.Error as insertedKey reads it.
type detailed interface {
	error
	Get(field byte) string
}

var _ sqllock.MultiReleaser = (*Backend)(nil)

// ReleaseAll implements [sqllock.MultiReleaser] with one statement and
// one commit (queries/release_batch.sql, the batch group commit sends):
// Release's rules per lease, rows locked in key order, so that two
// overlapping sets released at once cannot deadlock, and a row another
// transaction locks (a fenced transaction's FOR SHARE) skipped, never
// waited for. A lease the statement could not settle (its row was
// skipped, or changed under it) is released alone afterwards, in key
// order, with the single statement, which waits for the row as Release
// does and gives Release's answer; so does every lease on a table not at
// the latest schema version. A statement the server refused applied
// nothing, and each lease is then released alone; one whose reply was
// lost gives every lease Release's answer to a lost reply
// ([sqllock.ErrIndeterminate]).
//
// While the Backend's releases are busy (groupCommitInFlight release
// statements in flight), or for a single lease, each lease is released
// as Release releases it instead: it joins the releases' group commit,
// so that concurrent sets' releases share its statements and commits
// rather than each sending one of its own.
func (b *Backend) ReleaseAll(ctx context.Context, ls []sqllock.Lease) ([]error, error) {
	if err := sqllock.ValidateReleaseAll(ls); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, pg.NotSent(outcome.Release, ls[0].Key, true, err)
	}
	if q := b.releaseQ; q.Limit > 0 && (len(ls) == 1 || q.Sending() >= q.Limit) {
		out := make([]error, len(ls))
		var wg sync.WaitGroup
		for i, l := range ls {
			wg.Go(func() { out[i] = b.Release(ctx, l) })
		}
		wg.Wait()
		return out, nil
	}
	members := make([]*releaseMember, len(ls))
	for i, l := range ls {
		members[i] = &releaseMember{Req: l, Key: l.Key}
	}
	out := make([]error, len(ls))
	if len(ls) == 1 {
		members[0].Err = groupcommit.ErrAlone
	} else {
		b.sendReleases(ctx, members)
	}
	order := make([]int, len(ls))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(i, j int) int { return strings.Compare(ls[i].Key, ls[j].Key) })
	for _, i := range order {
		if out[i] = members[i].Err; out[i] == groupcommit.ErrAlone {
			out[i] = b.releaseAlone(ctx, ls[i])
		}
	}
	return out, nil
}
