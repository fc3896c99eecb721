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
	"sync"
	"sync/atomic"

	"github.com/go-sql-driver/mysql"

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

// errSentAlone is a member's result when it was the only member of its
// batch: it sends its request with the single statement and keeps the
// place in flight that its batch had.
var errSentAlone = errors.New("sole member")

// errAlone is a member's result when its batch could not settle it: the
// member sends its request alone, with the single statement.
var errAlone = errors.New("send alone")

// gcMember is one queued call.
type gcMember[Req, Res any] struct {
	req  Req
	key  string
	done chan struct{} // closed by the batch's sender when res and err are set

	res Res
	err error

	batch *gcBatch // nil while queued; guarded by the queue's mu
}

// gcBatch is what the members of one batch in flight share.
type gcBatch struct {
	live   int                // members still waiting for the reply; guarded by the queue's mu
	cancel context.CancelFunc // cancels the batch's statement: called when live reaches 0, or after it
}

// gcQueue coalesces the calls of one kind. It is safe for concurrent use.
type gcQueue[Req, Res any] struct {
	limit int // statements in flight before calls queue; 0: group commit off
	// calls is how many calls must be outstanding (this one included)
	// before one queues (groupCommitCalls; 0 in tests that batch few).
	calls int
	// send sends members as one batch statement, sets each member's res
	// and err (errAlone to have it sent alone) and returns; ctx ends only
	// when every member has left.
	send func(ctx context.Context, members []*gcMember[Req, Res])

	batches atomic.Int64 // batch statements sent (tests)
	alone   atomic.Int64 // members that a batch left to be sent alone (tests)

	outstanding atomic.Int64 // calls of this kind inside do

	mu       sync.Mutex
	inFlight int                   // statements of this kind in flight
	queue    []*gcMember[Req, Res] // in arrival order
}

// do runs one call of operation o: alone at once (single) while fewer than
// limit statements are in flight or at most calls calls are outstanding,
// else queued for the next batch.
func (q *gcQueue[Req, Res]) do(ctx context.Context, key string, req Req, single func(context.Context) (Res, error),
	o outcome.Op) (Res, error) {
	n := q.outstanding.Add(1)
	defer q.outstanding.Add(-1)
	q.mu.Lock()
	if q.inFlight < q.limit || n <= int64(q.calls) {
		q.inFlight++
		q.mu.Unlock()
		res, err := single(ctx)
		q.finished()
		return res, err
	}
	m := &gcMember[Req, Res]{req: req, key: key, done: make(chan struct{})}
	q.queue = append(q.queue, m)
	q.mu.Unlock()
	var zero Res
	select {
	case <-m.done:
	case <-ctx.Done():
		q.mu.Lock()
		select {
		case <-m.done: // answered meanwhile
			q.mu.Unlock()
		default:
			if m.batch == nil {
				// Still queued: leave, and nothing of this call is sent.
				q.queue = slices.DeleteFunc(q.queue, func(o *gcMember[Req, Res]) bool { return o == m })
				q.mu.Unlock()
				return zero, dialect.NotSent(o, key, true, ctx.Err())
			}
			m.batch.live--
			if m.batch.live == 0 {
				m.batch.cancel()
			}
			q.mu.Unlock()
			return zero, dialect.InFlight(o, key, true, ctx.Err())
		}
	}
	if (m.err == errSentAlone || m.err == errAlone) && ctx.Err() != nil {
		// Nothing of this call was applied: its batch did not settle it,
		// and it has not been sent alone.
		if m.err == errSentAlone {
			q.finished()
		}
		return zero, dialect.NotSent(o, key, true, ctx.Err())
	}
	switch m.err {
	case errSentAlone:
		res, err := single(ctx)
		q.finished()
		return res, err
	case errAlone:
		q.alone.Add(1)
		return single(ctx)
	}
	return m.res, m.err
}

// finished is called when a statement of this kind ends: the queue, if
// any, goes next as a batch, sent from a goroutine of its own, which keeps
// the finished statement's place in flight.
func (q *gcQueue[Req, Res]) finished() {
	q.mu.Lock()
	members, ctx, handed := q.take()
	if members == nil && !handed {
		q.inFlight--
	}
	q.mu.Unlock()
	if members != nil {
		go q.run(ctx, members)
	}
}

// run sends batches until the queue is empty.
func (q *gcQueue[Req, Res]) run(ctx context.Context, members []*gcMember[Req, Res]) {
	for members != nil {
		q.batches.Add(1)
		q.send(ctx, members)
		q.mu.Lock()
		members[0].batch.cancel()
		for _, m := range members {
			close(m.done)
		}
		var handed bool
		members, ctx, handed = q.take()
		if members == nil && !handed {
			q.inFlight--
		}
		q.mu.Unlock()
	}
}

// take removes the next batch from the queue: at most maxBatch members, in
// arrival order, one per key (a later request for a key stays queued). It
// returns nil when the queue is empty. A batch of one member is not sent
// as a batch: take hands that member the place in flight (handed), and it
// sends its request itself, with the single statement. q.mu is held.
func (q *gcQueue[Req, Res]) take() (members []*gcMember[Req, Res], ctx context.Context, handed bool) {
	if len(q.queue) == 0 {
		return nil, nil, false
	}
	seen := make(map[string]bool, len(q.queue))
	rest := q.queue[:0]
	for _, m := range q.queue {
		if len(members) == maxBatch || seen[m.key] {
			rest = append(rest, m)
			continue
		}
		seen[m.key] = true
		members = append(members, m)
	}
	clear(q.queue[len(rest):])
	q.queue = rest
	if len(members) == 1 {
		members[0].err = errSentAlone
		close(members[0].done)
		return nil, nil, true
	}
	ctx, cancel := context.WithCancel(context.Background())
	b := &gcBatch{cancel: cancel, live: len(members)}
	for _, m := range members {
		m.batch = b
	}
	return members, ctx, false
}

// acquireMember is a queued TryAcquire.
type acquireMember = gcMember[sqllock.AcquireRequest, sqllock.Lease]

// sendAcquires sends members (distinct keys) as one acquireBatchSQL.
func (b *Backend) sendAcquires(ctx context.Context, members []*acquireMember) {
	sorted := slices.Clone(members)
	slices.SortFunc(sorted, func(x, y *acquireMember) int { return strings.Compare(x.key, y.key) })
	elems := make([][5]any, len(sorted))
	at := make(map[string]*acquireMember, len(sorted))
	for i, m := range sorted {
		at[m.key] = m
		a := acquireArgs(m.req)
		var v any // JSON null: no value
		if a.value != nil {
			v = base64.StdEncoding.EncodeToString(m.req.Value)
		}
		elems[i] = [5]any{m.req.Key, a.lease, m.req.Owner, v, a.hold}
	}
	arg, err := json.Marshal(elems)
	if err != nil {
		for _, m := range members {
			m.err = errAlone
		}
		return
	}
	rows := make(map[*acquireMember]acquireRow, len(members))
	var sent error // the last statement's own error
	err = b.run(ctx, outcome.Acquire, members[0].key, func(ctx context.Context) (err error) {
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
			m.err = errAlone
			continue
		}
		m.res, m.err = acquired(m.req, r)
	}
}

// releaseMember is a queued Release.
type releaseMember = gcMember[sqllock.Lease, struct{}]

// sendReleases sends members (distinct keys) as one releaseBatchSQL.
func (b *Backend) sendReleases(ctx context.Context, members []*releaseMember) {
	sorted := slices.Clone(members)
	slices.SortFunc(sorted, func(x, y *releaseMember) int { return strings.Compare(x.key, y.key) })
	elems := make([][3]any, len(sorted))
	at := make(map[string]*releaseMember, len(sorted))
	for i, m := range sorted {
		at[m.key] = m
		elems[i] = [3]any{m.req.Key, m.req.Token, m.req.Owner}
	}
	arg, err := json.Marshal(elems)
	if err != nil {
		for _, m := range members {
			m.err = errAlone
		}
		return
	}
	rows := make(map[*releaseMember]releaseResult, len(members))
	var sent error // the last statement's own error
	err = b.run(ctx, outcome.Release, members[0].key, func(ctx context.Context) (err error) {
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
			m.err = errAlone // no row: alone, the single statement says so
			continue
		}
		m.err = b.released(m.req, r)
	}
}

// batchFailed sets every member's outcome after a batch statement of
// operation o failed with err (from run; sent is the statement's own
// error, nil when none was sent): a statement the server answered with an
// error was rolled back, and each member is sent alone; otherwise (a
// reply lost, no connection) each member gets the error the single
// statement would give, for its own key.
func batchFailed[Req, Res any](ctx context.Context, o outcome.Op, members []*gcMember[Req, Res], err, sent error) {
	var me *mysql.MySQLError
	refused := errors.As(err, &me)
	for _, m := range members {
		switch {
		case refused:
			m.err = errAlone
		case sent != nil:
			m.err = classify(ctx, o, m.key, sent)
		default:
			m.err = err
		}
	}
}
