package postgres

import (
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// The Backend runs its statements only on its pool, each in a transaction
// of its own. To look inside one statement's transaction (its transaction
// id, its synchronous_commit, the row locks it meets), these helpers send
// the Backend's own rendered statements on a caller's transaction, bound
// exactly as the Backend binds them, and return what the Backend reads from
// the row.

// txAcquired is the row of queries/acquire.sql.
type txAcquired struct {
	granted, held, changed bool
	token                  int64
	deadline, now          time.Time
	owner                  string
	value                  []byte
}

// txAcquire sends sql (b.full.acquire or b.full.acquireWait) on tx.
func txAcquire(t *testing.T, tx pgx.Tx, sql string, req sqllock.AcquireRequest) txAcquired {
	t.Helper()
	var r txAcquired
	var value []byte
	if len(req.Value) > 0 {
		value = req.Value
	}
	var shared int
	var waiting string
	require.NoError(t, tx.QueryRow(testCtx(t), sql, req.Key, leaseMicros(req.TTL), req.Owner, value, holdMicros(req.MinHold)).
		Scan(&r.granted, &r.token, &r.deadline, &r.held, &r.owner, &r.now, &r.changed, &r.value, &shared, &waiting))
	return r
}

// txRenew sends b's renewSQL for l on tx and returns whether it renewed,
// and the deadline.
func txRenew(t *testing.T, tx pgx.Tx, b *Backend, l sqllock.Lease, ttl time.Duration) (bool, time.Time) {
	t.Helper()
	var (
		renewed, held bool
		deadline, now time.Time
		token         int64
	)
	require.NoError(t, tx.QueryRow(testCtx(t), b.full.renew, l.Key, l.Token, leaseMicros(ttl)).
		Scan(&renewed, &deadline, &token, &held, &now))
	return renewed, deadline
}

// txRelease sends b's current release statement for l on tx and returns whether
// it released.
func txRelease(t *testing.T, tx pgx.Tx, b *Backend, l sqllock.Lease) bool {
	t.Helper()
	var (
		released, valid, held bool
		token, notified       int64
		deadline, now         time.Time
		owner                 string
	)
	st, err := b.statements(testCtx(t), outcome.Release, l.Key)
	require.NoError(t, err)
	require.NoError(t, tx.QueryRow(testCtx(t), st.release, l.Key, l.Token, l.Owner).
		Scan(&released, &valid, &token, &held, &deadline, &owner, &now, &notified))
	return released
}
