package mariadb

import (
	"context"
	"database/sql"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/go-sql-driver/mysql"

	"github.com/ashlock/ashlock/internal/groupcommit"
	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// Client-side group commit: concurrent TryAcquire calls of one Backend are
// coalesced into one statement (acquireBatchSQL, the single acquire's
// ON DUPLICATE KEY UPDATE over many rows), one commit and one log flush;
// so are concurrent Release calls (releaseBatchSQL, releaseSQL's clause
// over many rows), in statements of their own. The server also resolves the statement's expressions once per
// execution, not once per row, which is what the single acquire's long
// ON DUPLICATE KEY UPDATE clause costs it most (profiled: about a sixth
// of the server's time at 64 goroutines goes to mysql_prepare_insert and
// its fix_fields).
//
// It adds no latency to a Backend that is not busy: a call is sent at
// once, alone, with the single statement (acquireSQL; releaseHeldSQL),
// while fewer than groupCommitInFlight statements of its kind are in
// flight from this Backend, or at most groupCommitCalls calls of its kind
// are outstanding. Only a call that arrives while that many are in
// flight waits, in a queue; the sender of the next one to finish (single
// or batch) takes the queue and sends it as one batch, from a goroutine
// of its own, and again until the queue is empty. A queue of one call is
// sent with the single statement.
//
// The queue (who goes alone, who waits, the hand-off, a member that
// leaves) is internal/groupcommit's, which PostgreSQL and etcd share; this
// file is what MariaDB sends for a batch and how it reads the reply.
// The rules a batch keeps:
//   - one request per key in a batch: a second request for a key stays
//     queued for a later batch; at most maxBatch members;
//   - its rows in key order, so that two batches never lock rows in
//     opposite orders;
//   - each member's answer is the single statement's for its row: the
//     batch runs the single statement's ON DUPLICATE KEY UPDATE clause,
//     row by row, and its RETURNING, with the key; the answer is read by
//     the same code (acquired, released); a release whose key has no row
//     is absent from the reply and sent alone;
//   - a batch chosen as a deadlock's victim (1213) was rolled back: it is
//     repeated, as a single statement is, with every member; one the
//     server refused otherwise (a lock wait that ran out behind a fenced
//     transaction, a token at the end of its space, a missing table: any
//     error from the server, which rolled the statement back) applied
//     nothing: each member is then sent alone and gets the single
//     statement's answer;
//   - a member whose context ends while it is queued leaves the queue, and
//     nothing of it is ever sent (its error says "not sent"); one whose
//     context ends while its batch is in flight returns at once,
//     indeterminate, as the single statement does, and the batch goes on
//     for the others (it is cancelled only when every member has left);
//   - a batch whose reply is lost (connection broken after it was sent)
//     makes every member's outcome indeterminate, exactly as the single
//     statement's lost reply; the same owner's repeat gets its grant back
//     with its token.
//
// A batch waits for a row that a fenced transaction holds locked (there
// is no SKIP LOCKED for an INSERT), as the single statement does, for at
// most Options.LockWait: the other members of that batch wait with it.

// groupCommitInFlight is how many acquires (releases) a Backend sends concurrently
// before it queues further calls for a batch: 4, as the PostgreSQL
// backend's, whose measurements found that with 2 a third caller at 4
// goroutines waits where it could have gone at once.
const groupCommitInFlight = 4

// groupCommitCalls is how many calls of a kind (acquires, releases) a
// Backend must have outstanding (in flight alone, queued, or in a batch),
// this one included, before a call may queue for a batch: up to 16, every
// call is sent at once, alone, however many are in flight. With 4 in
// flight as the only rule, batches formed at 16 goroutines and lost
// there to DisableGroupCommit, once the single acquire no longer read
// the floor (0.70–0.75× raw against 0.90–0.95× in two runs of 5 rounds;
// with 8 in flight 0.72–0.74× against 0.81–0.85×): a batch of a few
// members waits for a statement to end, then for its own, while the
// server still has room for the single statements. Raising the in-flight
// limit to 16 instead kept 16 goroutines from batching but let 16 single
// statements run beside each batch at 64, where the server is the limit,
// and gave most of the batches' gain back (0.71–1.01× against 1.39–1.83×
// with 4). docs/mariadb.md has the figures.
const groupCommitCalls = 16

// maxBatch bounds the members of one batch statement (its JSON argument
// stays far below the server's default max_allowed_packet of 16 MiB:
// a member is at most about 7 KiB).
const maxBatch = 256

// newQueue returns the group commit queue of operation o (see the
// comment above), which send sends as batches.
func newQueue[Req, Res any](o outcome.Op, limit int, send func(context.Context, []*groupcommit.Member[Req, Res])) *groupcommit.Queue[Req, Res] {
	return &groupcommit.Queue[Req, Res]{Limit: limit, Calls: groupCommitCalls, MaxMembers: maxBatch, Send: send,
		NotSent:  func(key string, err error) error { return dialect.NotSent(o, key, true, err) },
		InFlight: func(key string, err error) error { return dialect.InFlight(o, key, true, err) }}
}

// acquireMember is a queued TryAcquire.
type acquireMember = groupcommit.Member[sqllock.AcquireRequest, sqllock.Lease]

// sendAcquires sends members (distinct keys) as one acquireBatchSQL.
func (b *Backend) sendAcquires(ctx context.Context, members []*acquireMember) {
	sorted := slices.Clone(members)
	slices.SortFunc(sorted, func(x, y *acquireMember) int { return strings.Compare(x.Key, y.Key) })
	elems := make([][5]any, len(sorted))
	at := make(map[string]*acquireMember, len(sorted))
	for i, m := range sorted {
		at[m.Key] = m
		a := acquireArgs(m.Req)
		var v any // JSON null: no value
		if a.value != nil {
			v = base64.StdEncoding.EncodeToString(m.Req.Value)
		}
		elems[i] = [5]any{m.Req.Key, a.lease, m.Req.Owner, v, a.hold}
	}
	arg, err := json.Marshal(elems)
	if err != nil {
		for _, m := range members {
			m.Err = groupcommit.ErrAlone
		}
		return
	}
	rows := make(map[*acquireMember]acquireRow, len(members))
	var sent error // the last statement's own error
	err = b.run(ctx, outcome.Acquire, members[0].Key, func(ctx context.Context) (err error) {
		defer func() { sent = err }()
		clear(rows)
		return b.queryEach(ctx, b.acquireBatchSQL, []any{string(arg)}, func(rs *sql.Rows) error {
			var key string
			var r acquireRow
			if err := rs.Scan(&key, &r.token, &r.held, &r.deadline, &r.owner, &r.value, &r.now, &r.kept); err != nil {
				return err
			}
			m, ok := at[key]
			if !ok {
				return fmt.Errorf("sqllock/mariadb: batch acquire returned an unknown key %q", key)
			}
			rows[m] = r
			return nil
		})
	})
	if err != nil {
		batchFailed(ctx, outcome.Acquire, members, err, sent)
		return
	}
	for _, m := range members {
		r, ok := rows[m]
		if !ok {
			m.Err = groupcommit.ErrAlone
			continue
		}
		m.Res, m.Err = acquired(m.Req, r)
	}
}

// releaseMember is a queued Release.
type releaseMember = groupcommit.Member[sqllock.Lease, struct{}]

// sendReleases sends members (distinct keys) as one releaseBatchSQL.
func (b *Backend) sendReleases(ctx context.Context, members []*releaseMember) {
	sorted := slices.Clone(members)
	slices.SortFunc(sorted, func(x, y *releaseMember) int { return strings.Compare(x.Key, y.Key) })
	elems := make([][3]any, len(sorted))
	at := make(map[string]*releaseMember, len(sorted))
	for i, m := range sorted {
		at[m.Key] = m
		elems[i] = [3]any{m.Req.Key, m.Req.Token, m.Req.Owner}
	}
	arg, err := json.Marshal(elems)
	if err != nil {
		for _, m := range members {
			m.Err = groupcommit.ErrAlone
		}
		return
	}
	rows := make(map[*releaseMember]releaseResult, len(members))
	var sent error // the last statement's own error
	err = b.run(ctx, outcome.Release, members[0].Key, func(ctx context.Context) (err error) {
		defer func() { sent = err }()
		clear(rows)
		return b.queryEach(ctx, b.releaseBatchSQL, []any{string(arg)}, func(rs *sql.Rows) error {
			var key string
			r := releaseResult{found: true}
			if err := rs.Scan(&key, &r.token, &r.held, &r.owner, &r.deadline, &r.now, &r.cleared, &r.expired); err != nil {
				return err
			}
			m, ok := at[key]
			if !ok {
				return fmt.Errorf("sqllock/mariadb: batch release returned an unknown key %q", key)
			}
			rows[m] = r
			return nil
		})
	})
	if err != nil {
		batchFailed(ctx, outcome.Release, members, err, sent)
		return
	}
	for _, m := range members {
		r, ok := rows[m]
		if !ok {
			m.Err = groupcommit.ErrAlone // no row: alone, the single statement says so
			continue
		}
		m.Err = b.released(m.Req, r)
	}
}

// batchFailed sets every member's outcome after a batch statement of
// operation o failed with err (from run; sent is the statement's own
// error, nil when none was sent): a statement the server answered with an
// error was rolled back, and each member is sent alone; otherwise (a
// reply lost, no connection) each member gets the error the single
// statement would give, for its own key.
func batchFailed[Req, Res any](ctx context.Context, o outcome.Op, members []*groupcommit.Member[Req, Res], err, sent error) {
	var me *mysql.MySQLError
	refused := errors.As(err, &me)
	for _, m := range members {
		switch {
		case refused:
			m.Err = groupcommit.ErrAlone
		case sent != nil:
			m.Err = classify(ctx, o, m.Key, sent)
		default:
			m.Err = err
		}
	}
}
