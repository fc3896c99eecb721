// Package sqllock provides distributed locks — leases with fencing tokens —
// whose authority is a database the application already runs: PostgreSQL
// for a fleet of hosts (package dialect/postgres), SQLite for the processes
// of one host (dialect/sqlite), or memory for one process (package memory).
//
// # Overview
//
// A [Client] takes leases from a [Backend]. [Client.TryAcquire] makes one
// attempt; [Client.Acquire] and [Client.Do] (which acquires, runs a
// function and releases) make one attempt too unless [AcquireOptions.Wait]
// says how long to wait ([WaitForever]: until the context ends), so a job
// that every replica fires runs once and the others skip it. Each returns or uses a [Guard]: the held lease, which the
// Client's renewal scheduler renews in the background (with the other
// leases due at about the same time, in one round trip where the backend
// can: [BatchRenewer]), and whose [Guard.Context] is cancelled the moment
// the holder can no longer be sure it holds the lock.
//
//	c, _ := sqllock.New(backend, sqllock.Options{})
//	err := c.Do(ctx, "nightly-report", nil, func(ctx context.Context, g *sqllock.Guard) error {
//		return build(ctx, g.Token()) // stop when ctx is done; fence writes with the token
//	})
//
// # Leases and TTL
//
// Every key's state is (token, held, deadline, owner), stored by the backend
// and changed only by single conditional statements. An acquire succeeds
// iff the key is free, released, or its deadline has passed by the
// database's clock; it sets token = previous token + 1 and deadline =
// database now + TTL. Renew extends the deadline iff the token is still
// current and unexpired; release clears held iff the token is current. The
// database clock alone decides expiry: clocks of different hosts are never
// compared.
//
//	          acquire (token+1)              release (token kept)
//	free ───────────────────────▶ held ─────────────────────────▶ free
//	 ▲                           │  ▲ │
//	 │        deadline passes    │  └─┘ renew (same token, deadline = now+TTL)
//	 └───────────────────────────┘
//	      (an acquire may take over an expired lease: token+1)
//
// The client keeps its own local deadline on the monotonic clock:
// (time just before the request was sent) + TTL - margin. The lease began at
// the database no earlier than the request was sent, so the local deadline
// is never later than the database's deadline, whatever the network delay,
// as long as the two clocks run at nearly the same rate. The scheduler
// renews every TTL/3 and retries transient errors until the local
// deadline; a lease renewed in a batch counts its local deadline from the
// batch's send time. Each renewal attempt may take half of what its
// earliest lease has left (at least 10 ms, never past the local
// deadline): one that hangs, on a half-open connection say, is abandoned
// then and sent again at once, so one stuck call never costs a lease.
//
// # Lease loss
//
// The Guard's context is cancelled, with a [*LostError] as its
// [context.Cause], at the first of: a renewal that finds the lease expired,
// taken by a newer token, or released; or the local deadline passing without
// a successful renewal (the backend unreachable or slow). A renewal that
// succeeds after the local deadline does not revive the Guard. Code under a
// lock must watch the context and stop.
//
// # Fencing tokens
//
// No lease lock can promise that two processes never act at once: a
// process paused (GC, swap, SIGSTOP) past its deadline, or a database clock
// that steps forward, lets a stale holder run on after a new holder took
// over. The answer is the fencing token, [Guard.Token]: strictly greater
// for every grant of a key. Pass it with every write to the protected
// resource, which keeps the highest token it has seen and refuses writes
// carrying a lower one:
//
//	UPDATE accounts SET balance = $1, fence = $2 WHERE id = $3 AND fence <= $2
//
// Then a stale holder's write is refused, whatever the timing.
//
// # Semaphores
//
// [Client.AcquirePermit] takes one of the N permits of a semaphore key
// (on a backend that implements [PermitAcquirer]): at most N holders at
// once. A permit is an ordinary lease of its own key ([PermitKey]), so
// its token orders the tenures of that permit only: fence per permit,
// keeping the highest token seen for each permit's key.
//
// # Several keys at once
//
// [Client.AcquireAll] takes a set of keys all or none, on a backend that
// implements [MultiAcquirer] (memory, SQLite, PostgreSQL): one statement,
// keys in a fixed order, so that overlapping sets never deadlock. Each
// key gets its own lease and token, as a single acquire would; the
// [GuardSet]'s context ends at the first loss of any of them.
//
// # Guarantees
//
// Under these assumptions — A1: the database is linearizable for our
// statements (one PostgreSQL primary, or one SQLite file on one host); A2:
// the database clock and each client's monotonic clock run at nearly the
// same rate and the database clock does not step by more than the margin;
// A3: a holder's whole-process pause is shorter than the margin — ashlock
// promises:
//
//   - G1: the database never records two unexpired grants of one key (A1).
//   - G2: each grant's token is strictly greater than every earlier token
//     of that key, across release, expiry, takeover, crash and restart; at
//     the end of the token space it fails with [ErrTokenExhausted], never
//     wraps.
//   - G3: a Guard's context is cancelled no later than the send time of the
//     last successful acquire or renew + TTL - margin (A2, A3).
//   - G4: a resource that applies writes only with token >= the highest it
//     has seen never applies a stale holder's write after a newer one (A1).
//   - G5: after a holder crashes, another contender acquires within TTL +
//     one poll interval + one round trip.
//   - G6: an outcome that is unknown (reply lost) is reported as
//     [ErrIndeterminate], never guessed; repeating the same acquire does not
//     create a second tenure.
//   - G7: invalid input fails before any I/O, the same way on every backend.
//   - G8: after Release or cancellation no goroutine of the Guard remains,
//     unless Release's context (or ReleaseTimeout) ended before the batch
//     renewing its lease returned: a batch that other live leases share
//     goes on to its end, and one that no live lease needs any more is
//     cancelled and its goroutine, with any connection it holds, ends when
//     the backend call returns. A Client with no Guards has no goroutine.
//     Backends may keep shared resources of their own until their Close
//     (the PostgreSQL backend's LISTEN connection).
//
// Not promised: exclusion for unfenced side effects when A2 or A3 fail;
// FIFO fairness among waiters; progress while the database is down;
// exactly-once work; safety across failover to an asynchronous standby; on
// SQLite the "database clock" is the host's wall clock.
//
// # Errors
//
// Every error matches a sentinel with [errors.Is]; two carry details for
// [errors.As]:
//
//   - [ErrNotAcquired] ([*HeldError]: holder, token, remaining lease): the
//     key is held. An Acquire given a Wait waits it out; TryAcquire, and
//     Acquire and Do without a Wait, return it.
//   - [ErrLeaseLost] ([*LostError]: expired, taken by a newer token,
//     released by someone else (a forced release, with who did it), or
//     not renewed before the local deadline, whether renewals failed, got
//     no reply or were never sent, as in a paused process): the lease is gone or
//     can no longer be trusted. It is the [context.Cause] of a lost Guard,
//     and Release returns it when the critical section may have overlapped
//     another holder's, also when a forced release ended the lease after
//     the last renewal.
//   - [ErrReleased]: the cause of a Guard's context after Release.
//   - [ErrIndeterminate]: a reply was lost; the operation may or may not
//     have been applied. The client settles acquires by repeating the same
//     request; when it cannot, no Guard is handed out and this is returned.
//   - [ErrUnavailable]: a transient backend failure (connection lost,
//     read-only server, busy SQLite file). The scheduler retries it until
//     the local deadline; it is never a loss by itself.
//   - [ErrInvalidKey], [ErrInvalidTTL], [ErrInvalidOwner],
//     [ErrInvalidToken]: bad input, refused before any I/O by every backend.
//   - [ErrSchemaMissing]: the lock table does not exist; run `sqllock
//     migrate up`.
//   - [ErrTokenExhausted]: the key's token reached the largest int64; it is
//     never reused, so the key cannot be granted again.
//   - [ErrClosed]: the Client was closed.
//
// # Observability
//
// [Options].Observer receives typed events: acquire attempts and calls
// (outcome, duration, for Acquire the wait and the attempts), renewals
// (outcome, round trip, and slack: what the local deadline had left when
// the reply arrived), releases (outcome, time held), losses (reason), and
// each Guard's start and end. A nil Observer costs nothing; with one, a
// Guard allocates one small struct for its events, and delivering them
// allocates nothing. Package otelsqllock, a module of its own,
// records them as OpenTelemetry metrics and spans. [Options].Logger gets
// losses and failures through the *Context methods of log/slog, with the
// attributes key, token, owner, backend, reason, attempt and err.
//
// # Choosing a backend
//
// PostgreSQL (dialect/postgres) serves many hosts: pass the application's
// *pgxpool.Pool. SQLite (dialect/sqlite) serves the processes of one host
// through one file. Package memory serves the goroutines of one process and
// is what the examples use. Every backend passes the conformance suite in
// package backendtest.
//
// # Migrations
//
// The SQL backends need their table: run `sqllock migrate up`, or call the
// migrations package (goose migrations with the library's own version
// table), or print the SQL with `sqllock migrate sql` for your own tool.
package sqllock
