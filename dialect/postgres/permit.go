package postgres

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"time"

	"github.com/ashlock/ashlock/internal/groupcommit"
	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

var _ sqllock.PermitAcquirer = (*Backend)(nil)

// permitStatements are the semaphore's statements: permit_acquire's plain
// form and its waiting form (sent while the semaphore is watched).
// acquireBatch is the group commit's statement (permit_acquire_batch).
type permitStatements struct {
	acquire, acquireWait, acquireBatch string
}

// permitVersion is the schema version semaphores need: every column up
// to 00005's (their rows are never reaped, so 00006's floor is not
// needed).
const permitVersion = 5

func renderPermit(table string, notify bool) permitStatements {
	s := schema{Table: table, Version: latest}
	plain := fill("permit_acquire", s)
	batch := fill("permit_acquire_batch", s)
	s.Notify = notify
	return permitStatements{acquire: plain, acquireWait: fill("permit_acquire", s), acquireBatch: batch}
}

// TryAcquirePermit implements [sqllock.PermitAcquirer] in one statement
// (queries/permit_acquire.sql), on the pgx pool or the *sql.DB alike. A
// refusal reports the holders and the soonest end from the same round
// trip; when the only free permits were locked by other transactions (or
// changed while the statement ran), or two first grants of a new
// semaphore raced, the [*sqllock.PermitsHeldError] names no holder: try
// again at once. Errors of an unknown outcome are as for TryAcquire:
// repeating the same request (same owner) returns the grant if it was
// applied. Semaphores need migration 00005 (permitVersion).
//
// Concurrent calls are coalesced as TryAcquire's are (group commit,
// batch.go): while groupCommitInFlight permit statements are in flight, a
// call waits in a queue, and the queue goes as one statement
// (queries/permit_acquire_batch.sql) and one commit, with one request per
// semaphore and owner and several per semaphore. A request that the batch
// cannot answer as the single statement would is sent again alone.
func (b *Backend) TryAcquirePermit(ctx context.Context, req sqllock.PermitRequest) (sqllock.Lease, error) {
	if err := req.Validate(); err != nil {
		return sqllock.Lease{}, err
	}
	if err := ctx.Err(); err != nil {
		return sqllock.Lease{}, pg.NotSent(outcome.Acquire, req.Key, true, err)
	}
	st, err := b.statements(ctx, outcome.Acquire, req.Key)
	if err != nil {
		return sqllock.Lease{}, err
	}
	if st.version < permitVersion {
		return sqllock.Lease{}, fmt.Errorf("%w: table %s is at schema version %d; semaphores need migration %05d (run `sqllock migrate up`, then rebuild the Backend)",
			sqllock.ErrSchemaMissing, b.table, st.version, permitVersion)
	}
	watched := b.watched(req.Key)
	if watched || b.permitQ.Limit == 0 {
		return b.tryAcquirePermit(ctx, req, watched)
	}
	// One call per semaphore and owner in a batch: a same-owner repeat
	// waits for the batch that carries the first.
	return b.permitQ.Do(ctx, req.Key+"\x00"+req.Owner, req.Permits, req, func(ctx context.Context) (sqllock.Lease, error) {
		return b.tryAcquirePermit(ctx, req, false)
	})
}

// tryAcquirePermit sends req alone, in the waiting form when watched.
func (b *Backend) tryAcquirePermit(ctx context.Context, req sqllock.PermitRequest, watched bool) (sqllock.Lease, error) {
	q := b.permit.acquire
	if watched {
		q = b.permit.acquireWait
	}
	args := []any{req.Key, leaseMicros(req.TTL), req.Owner, nonEmpty(req.Value), req.Permits}
	var r permitRow
	for attempt := 1; ; attempt++ {
		err := b.queryRow(ctx, q, args, &r.key, &r.token, &r.deadline, &r.now, &r.permits, &r.free, &r.exhausted, &r.holders)
		if err != nil {
			return sqllock.Lease{}, b.translate(ctx, outcome.Acquire, req.Key, err)
		}
		// permits = 0: the statement found no semaphore, and its insert
		// of the limit waited for a concurrent first grant's and did
		// nothing. That grant has committed by then, so the statement
		// sent once more finds the semaphore and its free permits,
		// instead of reporting N held permits on first use.
		if r.key != "" || r.permits != 0 || attempt == 2 {
			return permitted(req, r)
		}
	}
}

// permitMember is a queued TryAcquirePermit.
type permitMember = groupcommit.Member[sqllock.PermitRequest, sqllock.Lease]

// maxPermitRows bounds the permit rows one batch reads: a request counts
// its semaphore's limit.
const maxPermitRows = 4096

// sendPermits sends members (distinct semaphore and owner) as one
// permit_acquire_batch.sql.
func (b *Backend) sendPermits(ctx context.Context, members []*permitMember) {
	if !batches(ctx, b, members) {
		return
	}
	n := len(members)
	sems, owners := make([]string, n), make([]string, n)
	micros, limits := make([]int64, n), make([]int64, n)
	values := make([][]byte, n)
	for i, m := range members {
		sems[i], owners[i], micros[i], limits[i] = m.Req.Key, m.Req.Owner, leaseMicros(m.Req.TTL), int64(m.Req.Permits)
		values[i] = nonEmpty(m.Req.Value) // nil: NULL
	}
	rows := make([]permitRow, n)
	alone := make([]bool, n)
	got := make([]bool, n)
	var ord int64
	var r permitRow
	var a bool
	err := b.queryRows(ctx, b.permit.acquireBatch, []any{sems, micros, owners, values, limits},
		[]any{&ord, &r.key, &r.token, &r.deadline, &r.now, &r.permits, &a, &r.free, &r.exhausted, &r.holders}, func() error {
			if ord < 1 || ord > int64(n) || got[ord-1] {
				return fmt.Errorf("sqllock/postgres: batch permit acquire returned request %d unknown or twice", ord)
			}
			rows[ord-1], alone[ord-1], got[ord-1] = r, a, true
			return nil
		})
	if err != nil {
		batchFailed(ctx, b, outcome.Acquire, members, err)
		return
	}
	for i, m := range members {
		switch {
		case !got[i], alone[i]:
			m.Err = groupcommit.ErrAlone
		default:
			m.Res, m.Err = permitted(m.Req, rows[i])
		}
	}
}

// permitRow is what queries/permit_acquire.sql returns.
type permitRow struct {
	key             string // the permit granted, "" for none
	token, permits  int64
	free, exhausted int64
	deadline, now   time.Time
	holders         string // JSON
}

// permitted is TryAcquirePermit's answer to req from its statement's row.
func permitted(req sqllock.PermitRequest, r permitRow) (sqllock.Lease, error) {
	switch {
	case r.key != "":
		return sqllock.Lease{Key: r.key, Token: r.token, Owner: req.Owner, Deadline: r.deadline, BackendTime: r.now, Value: nonEmpty(req.Value)}, nil
	case r.permits != 0 && r.permits != int64(req.Permits):
		return sqllock.Lease{}, &sqllock.PermitLimitError{Key: req.Key, Asked: req.Permits, Stored: int(r.permits)}
	case r.permits == 0 || r.free > 0:
		// A first grant that lost the race to create the semaphore, or
		// free permits that were locked or taken while the statement ran.
		return sqllock.Lease{}, sqllock.NewPermitsHeldError(req.Key, req.Permits, nil)
	case r.exhausted > 0:
		return sqllock.Lease{}, fmt.Errorf("%w: semaphore %q", sqllock.ErrTokenExhausted, req.Key)
	}
	var hs []struct {
		Key, Owner string
		Token      int64
		Value      *string
		US         int64 `json:"us"`
	}
	if err := json.Unmarshal([]byte(r.holders), &hs); err != nil {
		return sqllock.Lease{}, fmt.Errorf("sqllock/postgres: %s %q: the holders: %w", outcome.Acquire, req.Key, err)
	}
	holders := make([]sqllock.PermitHolder, len(hs))
	for i, h := range hs {
		holders[i] = sqllock.PermitHolder{Key: h.Key, Owner: h.Owner, Token: h.Token, Remaining: time.Duration(max(h.US, 0)) * time.Microsecond}
		if h.Value != nil {
			v, err := base64.StdEncoding.DecodeString(*h.Value)
			if err != nil {
				return sqllock.Lease{}, fmt.Errorf("sqllock/postgres: %s %q: a holder's value: %w", outcome.Acquire, req.Key, err)
			}
			holders[i].Value = nonEmpty(v)
		}
	}
	return sqllock.Lease{}, sqllock.NewPermitsHeldError(req.Key, req.Permits, holders)
}

// signal wakes the watchers of a released key and, for a permit, of its
// semaphore.
func (l *listener) signal(key string) {
	l.signals.Signal(key)
	if sem, _, ok := sqllock.ParsePermitKey(key); ok {
		l.signals.Signal(sem)
	}
}
