package sqlite

import (
	"context"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

var _ sqllock.MultiAcquirer = (*Backend)(nil)

// TryAcquireAll implements [sqllock.MultiAcquirer] with one statement
// (queries/acquire_all.sql): every key of the set granted, or none, and
// a refusal names the first key in key order that acquire would refuse,
// from the same statement.
func (b *Backend) TryAcquireAll(ctx context.Context, req sqllock.MultiAcquireRequest) ([]sqllock.Lease, error) {
	if err := req.Validate(); err != nil {
		return nil, err
	}
	sorted := sqllock.SortedKeys(req.Keys)
	keys, err := json.Marshal(sorted)
	if err != nil {
		return nil, err
	}
	var value any // NULL for no value
	if len(req.Value) > 0 {
		value = req.Value
	}
	type row struct {
		token, deadline int64
		held, kept      bool
		owner           string
		value           []byte
	}
	rows := make(map[string]row, len(sorted))
	var now int64
	err = b.write(ctx, outcome.Acquire, sorted[0], func(ctx context.Context) error {
		clear(rows)
		var key string
		var r row
		return b.queryRows(ctx, outcome.Acquire, b.acquireAllSQL, []any{sorted[0], string(keys), leaseMillis(req.TTL), req.Owner, value},
			[]any{&key, &r.token, &r.held, &r.deadline, &r.owner, &r.value, &now, &r.kept}, func() {
				rows[key] = r
				r.value = nil // scanned fresh for the next row
			})
	})
	if err != nil {
		return nil, b.translate(err, true)
	}
	granted := func(r row) bool { return r.held && r.deadline > now && r.owner == req.Owner }
	for _, k := range sorted {
		r, ok := rows[k]
		switch {
		case ok && granted(r):
			continue
		case ok && (r.held || r.kept) && r.deadline > now: // kept: released inside its min hold
			return nil, &sqllock.HeldError{Key: k, Owner: r.owner, Token: r.token, Remaining: remaining(r.deadline, now), Value: nonEmpty(r.value)}
		case ok && r.token == math.MaxInt64:
			return nil, fmt.Errorf("%w: key %q", sqllock.ErrTokenExhausted, k)
		case ok || len(rows) != 1:
			return nil, fmt.Errorf("sqllock/sqlite: TryAcquireAll %q: unexpected row for %q (found %v, token %d, held %v, deadline %d, now %d; %d rows)",
				req.Keys, k, ok, r.token, r.held, r.deadline, now, len(rows))
		}
		// Not returned: the set was refused by another key, which comes
		// later in key order.
	}
	out := make([]sqllock.Lease, len(req.Keys))
	for i, k := range req.Keys {
		r := rows[k]
		if !granted(r) {
			return nil, fmt.Errorf("sqllock/sqlite: TryAcquireAll %q: no grant of %q among %d rows", req.Keys, k, len(rows))
		}
		out[i] = sqllock.Lease{Key: k, Token: r.token, Owner: req.Owner, Deadline: time.UnixMilli(r.deadline), BackendTime: time.UnixMilli(now), Value: nonEmpty(r.value)}
	}
	return out, nil
}

// queryRows is queryRow for a statement that returns many rows: it scans
// each into dest and calls each, and reads on to the end (the step after
// the last row commits an autocommit write). args[0] names the statement
// in a not-sent error (see shield) and is not sent: the statement's own
// arguments are args[1:], as ?1, ?2 and on.
func (b *Backend) queryRows(ctx context.Context, o outcome.Op, query string, args []any, dest []any, each func()) error {
	stmt, err := b.stmt(ctx, query)
	if err != nil {
		return err
	}
	sctx, gated, g, release := shield(ctx, o, args[1:])
	defer release()
	g.key, _ = args[0].(string)
	rows, err := stmt.QueryContext(sctx, gated...)
	if err != nil {
		return g.notSent(err)
	}
	defer rows.Close()
	for rows.Next() {
		if err := rows.Scan(dest...); err != nil {
			return err
		}
		each()
	}
	if err := rows.Err(); err != nil {
		return err
	}
	return rows.Close()
}

var _ sqllock.MultiReleaser = (*Backend)(nil)

// ReleaseAll implements [sqllock.MultiReleaser] with one statement
// (queries/release_all.sql), one commit, for every lease: each lease
// whose token is current and held is released by it, at one instant;
// for each of the others a read (peek.sql, as Release makes) tells its
// answer, as Release's. A lease held again with its token between the
// statement and the read (re-granted to its owner by a retried acquire)
// is released again by the statement, as Release tries again.
func (b *Backend) ReleaseAll(ctx context.Context, ls []sqllock.Lease) ([]error, error) {
	if err := sqllock.ValidateReleaseAll(ls); err != nil {
		return nil, err
	}
	out := make([]error, len(ls))
	settled := make([]bool, len(ls))
	var cleared []string
	err := b.write(ctx, outcome.Release, ls[0].Key, func(ctx context.Context) error {
		var todo []int
		elems := make([][3]any, 0, len(ls))
		for i, l := range ls {
			if !settled[i] {
				todo = append(todo, i)
				elems = append(elems, [3]any{l.Key, l.Token, l.Owner})
			}
		}
		arg, err := json.Marshal(elems)
		if err != nil {
			return err
		}
		type row struct{ deadline, now int64 }
		rows := make(map[string]row, len(todo))
		var key string
		var r row
		err = b.queryRows(ctx, outcome.Release, b.releaseAllSQL, []any{ls[todo[0]].Key, string(arg)},
			[]any{&key, &r.deadline, &r.now}, func() { rows[key] = r })
		if err != nil {
			return err
		}
		retry := false
		for _, i := range todo {
			l := ls[i]
			if r, ok := rows[l.Key]; ok {
				settled[i] = true
				cleared = append(cleared, l.Key)
				if r.deadline <= r.now {
					out[i] = &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostExpired}
				}
				continue
			}
			var (
				token, deadline, now int64
				held                 bool
				owner                string
			)
			found, err := b.queryRow(ctx, outcome.Release, b.peekSQL, []any{l.Key}, &token, &held, &deadline, &owner, &now)
			if err != nil {
				return err
			}
			st := keyState(found, token, held, deadline, now, owner)
			switch lost := st.Loss(l); {
			case st.ReleasedByOwner(l):
				settled[i] = true // released before by its owner
			case lost != nil:
				settled[i], out[i] = true, lost
			default:
				retry = true // held with l's token again: release it again
			}
		}
		if retry {
			return errRetry
		}
		return nil
	})
	for _, k := range cleared {
		b.signal(k)
	}
	if err != nil {
		err = b.translate(err, true)
		if !slices.Contains(settled, true) {
			return nil, err
		}
		// Some leases were settled before the failure: theirs are known.
		for i := range out {
			if !settled[i] {
				out[i] = err
			}
		}
	}
	return out, nil
}
