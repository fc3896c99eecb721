package postgres

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgconn"

	"github.com/ashlock/ashlock/internal/groupcommit"
	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// TryRenewBatch implements [sqllock.BatchRenewer] in one statement and one
// commit (see queries/renew_batch.sql), whatever the number of leases. A lease whose
// row another transaction holds locked (a fenced transaction, a waiter's
// mark) is not waited for: its result is a transient error, and the client
// renews it on its own. A batch of unknown outcome (context ended or
// connection broke in flight) is [sqllock.ErrUnavailable] for every
// lease: repeating it is safe.
func (b *Backend) TryRenewBatch(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
	if err := sqllock.ValidateRenewBatch(reqs); err != nil {
		return nil, err
	}
	if len(reqs) == 0 {
		return nil, nil
	}
	if err := ctx.Err(); err != nil {
		return nil, pg.NotSent(outcome.Renew, reqs[0].Lease.Key, true, err)
	}
	if slices.ContainsFunc(reqs, isShared) {
		return b.renewBatchWithShared(ctx, reqs)
	}
	return b.renewBatch(ctx, reqs)
}

// renewBatch is TryRenewBatch of valid, exclusive leases.
func (b *Backend) renewBatch(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
	// Each lease once, with the longest TTL asked for it.
	type id struct {
		key   string
		token int64
	}
	at := make(map[id]int, len(reqs))
	keys := make([]string, 0, len(reqs))
	tokens := make([]int64, 0, len(reqs))
	micros := make([]int64, 0, len(reqs))
	for _, r := range reqs {
		k := id{r.Lease.Key, r.Lease.Token}
		m := leaseMicros(r.TTL)
		if i, ok := at[k]; ok {
			micros[i] = max(micros[i], m)
			continue
		}
		at[k] = len(keys)
		keys, tokens, micros = append(keys, k.key), append(tokens, k.token), append(micros, m)
	}
	type row struct {
		renewed, held bool
		current       int64
		deadline, now time.Time
	}
	rows := make([]row, len(keys))
	var key string
	var token int64
	var r row
	err := b.queryRowsVia(ctx, sendOpts{aside: true}, b.full.renewBatch, []any{keys, tokens, micros},
		[]any{&key, &token, &r.renewed, &r.deadline, &r.current, &r.held, &r.now}, func() error {
			i, ok := at[id{key, token}]
			if !ok {
				return fmt.Errorf("sqllock/postgres: batch renewal returned an unknown lease %q token %d", key, token)
			}
			rows[i] = r
			return nil
		})
	if err != nil {
		return nil, b.translate(ctx, outcome.Renew, keys[0], err)
	}
	out := make([]sqllock.RenewResult, len(reqs))
	for j, rq := range reqs {
		l := rq.Lease
		r := rows[at[id{l.Key, l.Token}]]
		switch {
		case r.now.IsZero():
			out[j].Err = fmt.Errorf("%w: sqllock/postgres: batch renewal returned no row for %q token %d", sqllock.ErrUnavailable, l.Key, l.Token)
		case r.renewed:
			l.Deadline, l.BackendTime = r.deadline, r.now
			out[j].Lease = l
		case r.current == l.Token && r.held && r.deadline.After(r.now):
			out[j].Err = fmt.Errorf("%w: sqllock/postgres: the row of %q was locked by another transaction; renew it alone", sqllock.ErrUnavailable, l.Key)
		default:
			out[j].Err = lostReason(l, r.current, r.held, r.deadline, r.now)
		}
	}
	return out, nil
}

// Client-side group commit (issue 14): concurrent TryAcquire calls of one
// Backend, and concurrent Release calls, are coalesced into one statement
// and one commit per kind, so that many grants share one WAL flush.
//
// It never adds latency to a process that is not busy: a call is sent at
// once, alone, with the ordinary single-key statement (queries/acquire.sql,
// queries/release.sql), while fewer than groupCommitInFlight statements of its kind
// are in flight from this Backend. Only a call that arrives while that
// many are in flight waits, in a queue; the sender of the next statement
// of that kind to finish (single or batch) takes the queue and sends it as
// one batch statement (acquire_batch.sql, release_batch.sql), and again until
// the queue is empty. A queue of one call is sent with the single
// statement: for one key the batch statement costs the server more (about
// twice the single statement's execution) and saves no commit. An idle
// TryAcquire is therefore exactly the single statement and one round
// trip, as without group commit.
//
// Why one unnest statement per batch, and not the single statements
// pipelined in one transaction (pgx.Batch): the single statements would
// have to change anyway (each would need a SKIP LOCKED form so that a
// locked row does not stall the transaction, and the waiting form's
// asynchronous mark must never share a transaction with a grant), one
// statement plans and executes once for the whole batch (the server's CPU
// is what limits a busy two-core machine once commits are shared), and one
// failing key could not abort the others' statements. Measured in the
// bench module, section groupcommit.
//
// The queue (who goes alone, who waits, the hand-off, a member that
// leaves) is internal/groupcommit's, which MariaDB and etcd share; this
// file is what PostgreSQL sends for a batch and how it reads the reply.
// The rules a batch keeps (see queries/acquire_batch.sql and
// queries/release_batch.sql):
//   - one request per key in a batch: a second request for a key stays
//     queued for a later batch;
//   - rows locked in key order, and a row locked by another transaction
//     (a fenced transaction's FOR SHARE) skipped, never waited for: its
//     member is sent again alone, with the single statement, which waits;
//   - a member whose context ends while it is queued leaves the queue, and
//     nothing of it is ever sent (its error says "not sent"); one whose
//     context ends while its batch is in flight returns at once with
//     [sqllock.ErrIndeterminate], as the single statement does, and the
//     batch goes on for the others (it is cancelled only when every member
//     has left);
//   - a batch whose reply is lost (connection broken, commit not
//     settled) makes every member's outcome indeterminate, exactly as the
//     single statement's lost reply; the same owner's repeat gets its grant
//     back with its token;
//   - a batch that the server refused (a deadlock or serialization failure
//     after the usual resends, a missing column, any error from the
//     server, which rolled it back) applied nothing: each member is then
//     sent alone, and gets the single statement's answer;
//   - acquires that wait (the waiting form, while the key is watched) are
//     never coalesced: they mostly find the key held, commit nothing, and
//     so gain nothing from a shared commit, and their mark commits
//     asynchronously, which must never reach a transaction that grants;
//   - on a table not at the latest schema version nothing is coalesced.

// groupCommitInFlight is how many statements of one kind (acquire, release)
// a Backend sends concurrently before it queues further calls for a batch.
// Measured with the bench module (section groupcommit, 5 rounds, pairs/s
// against the same Backend without group commit): with 4, 1.06× at 4
// goroutines (which never queue), 1.11× at 16, 1.96× at 64; with 2, 0.82×
// at 4 (a third call waits for a statement in flight where it could have
// gone at once, and commits are not yet the limit), 1.09× at 16, 2.00× at
// 64; 1 coalesced most at 64 and lost the most at 4. Fewer in flight means
// bigger batches and fewer commits, and more waiting.
const groupCommitInFlight = 4

// maxBatch bounds the members of one batch statement.
const maxBatch = 1024

// newQueue returns the group commit queue of operation o (see the
// comment above), which send sends as batches.
func newQueue[Req, Res any](o outcome.Op, limit int, send func(context.Context, []*groupcommit.Member[Req, Res])) *groupcommit.Queue[Req, Res] {
	return &groupcommit.Queue[Req, Res]{Limit: limit, MaxMembers: maxBatch, Send: send,
		NotSent:  func(key string, err error) error { return pg.NotSent(o, queuedKey(key), true, err) },
		InFlight: func(key string, err error) error { return pg.InFlight(o, queuedKey(key), true, err) }}
}

// queuedKey is the key a queue's member key names: a permit's member key
// is its semaphore's, then a NUL (which no key holds) and its owner.
func queuedKey(k string) string {
	key, _, _ := strings.Cut(k, "\x00")
	return key
}

// batchFailed sets every member's outcome after a batch statement failed
// with err: a statement the server refused was rolled back, and each
// member is sent alone; otherwise (a reply lost, a commit not settled, no
// connection) each member gets the error the single statement would give.
func batchFailed[Req, Res any](ctx context.Context, b *Backend, o outcome.Op, members []*groupcommit.Member[Req, Res], err error) {
	_, refused := errors.AsType[*pgconn.PgError](err)
	if _, unsettled := errors.AsType[*unsettledError](err); unsettled {
		refused = false
	}
	for _, m := range members {
		if refused {
			m.Err = groupcommit.ErrAlone
			continue
		}
		m.Err = b.translate(ctx, o, queuedKey(m.Key), err)
	}
}

// acquireMember is a queued TryAcquire.
type acquireMember = groupcommit.Member[sqllock.AcquireRequest, sqllock.Lease]

// sendAcquires sends members (distinct keys) as one acquire_batch.sql.
func (b *Backend) sendAcquires(ctx context.Context, members []*acquireMember) {
	if !batches(ctx, b, members) {
		return
	}
	at := make(map[string]int, len(members))
	keys := make([]string, len(members))
	micros := make([]int64, len(members))
	owners := make([]string, len(members))
	values := make([][]byte, len(members))
	holds := make([]int64, len(members))
	for i, m := range members {
		at[m.Key] = i
		keys[i], micros[i], owners[i], holds[i] = m.Req.Key, leaseMicros(m.Req.TTL), m.Req.Owner, holdMicros(m.Req.MinHold)
		if len(m.Req.Value) > 0 {
			values[i] = m.Req.Value // else nil: NULL
		}
	}
	rows := make([]acquireRow, len(members))
	got := make([]bool, len(members))
	var key string
	var r acquireRow
	err := b.queryRows(ctx, b.full.acquireBatch, []any{keys, micros, owners, values, holds},
		[]any{&key, &r.granted, &r.token, &r.deadline, &r.held, &r.owner, &r.now, &r.skipped, &r.value, &r.shared, &r.waiting}, func() error {
			i, ok := at[key]
			if !ok {
				return fmt.Errorf("sqllock/postgres: batch acquire returned an unknown key %q", key)
			}
			rows[i], got[i] = r, true
			r.value = nil // scanned fresh for the next row
			return nil
		})
	if err != nil {
		batchFailed(ctx, b, outcome.Acquire, members, err)
		return
	}
	for i, m := range members {
		switch {
		case !got[i], rows[i].skipped:
			m.Err = groupcommit.ErrAlone
		default:
			m.Res, m.Err = acquired(m.Req, rows[i])
		}
	}
}

// releaseMember is a queued Release.
type releaseMember = groupcommit.Member[sqllock.Lease, struct{}]

// sendReleases sends members (distinct keys) as one release_batch.sql.
func (b *Backend) sendReleases(ctx context.Context, members []*releaseMember) {
	if !batches(ctx, b, members) {
		return
	}
	at := make(map[string]int, len(members))
	keys := make([]string, len(members))
	tokens := make([]int64, len(members))
	owners := make([]string, len(members))
	for i, m := range members {
		at[m.Key] = i
		keys[i], tokens[i], owners[i] = m.Req.Key, m.Req.Token, m.Req.Owner
	}
	type row struct {
		released, valid, held bool
		current, notified     int64
		deadline, now         time.Time
		owner                 string
	}
	rows := make([]row, len(members))
	got := make([]bool, len(members))
	var key string
	var r row
	err := b.queryRowsVia(ctx, sendOpts{aside: true}, b.full.releaseBatch, []any{keys, tokens, owners},
		[]any{&key, &r.released, &r.valid, &r.current, &r.held, &r.deadline, &r.owner, &r.now, &r.notified}, func() error {
			i, ok := at[key]
			if !ok {
				return fmt.Errorf("sqllock/postgres: batch release returned an unknown key %q", key)
			}
			rows[i], got[i] = r, true
			return nil
		})
	if err != nil {
		batchFailed(ctx, b, outcome.Release, members, err)
		return
	}
	for i, m := range members {
		r, l := rows[i], m.Req
		switch {
		case !got[i]:
			m.Err = groupcommit.ErrAlone
		case r.released && r.valid:
		case r.released:
			m.Err = &sqllock.LostError{Key: l.Key, Token: l.Token, Reason: sqllock.LostExpired}
		case r.current == l.Token && r.held:
			// Skipped (its row was locked), or changed since the
			// snapshot: alone, the single statement waits for the row and
			// reads what happened.
			m.Err = groupcommit.ErrAlone
		default:
			if err := releasedLost(l, r.current > 0, r.current, r.held, r.owner); err == errRaced {
				m.Err = groupcommit.ErrAlone
			} else {
				m.Err = err
			}
		}
	}
}

// batches reports whether members can go as a batch: only at the latest
// schema version (the batch statements use every column). Otherwise, or
// when the version cannot be read, each member is sent alone (groupcommit.ErrAlone),
// and gets the single statement's answer.
func batches[Req, Res any](ctx context.Context, b *Backend, members []*groupcommit.Member[Req, Res]) bool {
	st, err := b.statements(ctx, outcome.Acquire, members[0].Key)
	if err == nil && st.version == latest {
		return true
	}
	for _, m := range members {
		m.Err = groupcommit.ErrAlone
	}
	return false
}
