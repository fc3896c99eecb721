// Package etcd is a [sqllock.Backend] on an etcd cluster: the same lease
// semantics as the SQL backends, with etcd as the authority. Use it when
// the locks should not live in the application's database, or when a 3- or
// 5-member etcd cluster already runs beside the fleet.
//
// It is a Go module of its own, so programs that never use etcd never
// download its client. [New] takes the application's *clientv3.Client and
// never closes it.
//
// # Keys
//
// Under [Options.Prefix] (default "sqllock/") each lock key K has up to
// four etcd keys:
//
//	<prefix>t/K  the token record: the key's current token and the owner
//	             it was granted to (JSON); written by every grant, deleted
//	             only by a reap ([Backend.Reap]), which raises the floor
//	<prefix>h/K  the holder: the current token in decimal, attached to an
//	             etcd lease; it exists exactly while the grant is held and
//	             unexpired by etcd (a release deletes it, etcd's expiry of
//	             the lease deletes it)
//	<prefix>r/K  the last release: the token released, who released it,
//	             the released etcd lease and its TTL
//	<prefix>m/K  the min hold of the current grant, when it was asked for
//	             one ([sqllock.AcquireRequest.MinHold]): its token and
//	             owner (JSON), attached to an etcd lease of its own
//
// A semaphore K's permit i is the lock key K#permit-i, with these keys
// (never a min hold), and its limit N the token record of K#permits
// (token N, never held), written by the semaphore's first grant.
//
// Beside them: <prefix>floor, at least the largest token of every key
// ever reaped, and <prefix>c/R, a reap's clock entries (see
// [Backend.Reap] and docs/key-reaping.md). A reader of K (a shared
// grant) holds reader slot K#shared-i with these keys, and puts
// <prefix>m/K\x00i on its etcd lease; a waiting writer's mark is
// <prefix>w/K on an etcd lease of its own (see shared.go and
// docs/shared-locks.md).
//
// A grant is one etcd transaction that compares the token record's
// revision and the absence of the holder and of the min-hold key, and
// writes the token record (token + 1) and the holder (and the min-hold
// key); so tokens are a per-key counter, exactly previous + 1,
// across release, expiry, member restart and whole-cluster restart. A
// key's first grant (no token record) takes the floor + 1 and compares
// the floor's revision unchanged, so a reaped key continues above every
// token it had. Deleting
// these keys by hand (etcdctl del) restarts a key's tokens: never do that;
// end a lease with a release instead.
//
// # Time
//
// etcd decides expiry: a lease ends when the etcd leader's lease for the
// holder key expires. etcd leases have whole-second TTLs and a server
// minimum (ceil(1.5 × election timeout), 2 s with etcd's default 1 s
// election timeout), so the backend rounds a TTL up to whole seconds and
// the server may raise it further: a 200 ms TTL becomes 1 s, which a
// default-configured server grants as 2 s. Rounding is always up, never
// down. A leader change only extends leases (the new leader restarts
// every lease's TTL), which is safe: a holder's local deadline is earlier
// still. Takeover after a crashed holder therefore comes at the granted TTL
// after the holder's last renewal, plus up to one election timeout when the
// leader changed meanwhile.
//
// etcd does not expose its clock, so a Lease's BackendTime is this host's
// wall clock just before the request that started the etcd lease's current
// period (the grant, or a keep-alive) was sent, and Deadline
// is BackendTime plus the TTL etcd granted: the earliest moment etcd can
// end the lease, as seen from this host. Deadline.Sub(BackendTime) is the
// granted TTL. The client's local deadline (send time + TTL − margin) is
// never later than etcd's expiry, because the etcd lease is granted, or
// kept alive, only after the acquire or renew was sent, and with a TTL at
// least the one requested. [sqllock.LockInfo.Deadline] and
// [sqllock.HeldError.Remaining] come from etcd's lease time-to-live, which
// etcd reports in whole seconds, rounded down.
//
// # Minimum hold
//
// etcd has no clock in a transaction, but its leases expire by the etcd
// leader's clock. A grant with a MinHold gets two etcd leases, granted at
// the same time after the request's send time: the holder's (TTL) and
// the min hold's (MinHold, rounded up to whole seconds and raised to the
// server's minimum as every TTL is), and its transaction puts the
// min-hold key on the second. A key is taken while its holder key or its
// min-hold key exists: the release by the grant's own owner deletes the
// holder and leaves the min-hold key (a nested transaction compares its
// token and owner), so the key stays taken, by that owner with that
// token, until etcd expires the hold's lease, with no client alive; a
// release after that frees the key at once; a forced release (another
// owner's) deletes the min-hold key too. A holder that crashes keeps the
// key until the later of its own etcd lease's end and the hold's. A hold
// lasts at least MinHold by etcd's clock, and may last longer: whole
// seconds, the server's minimum TTL (2 s by default), and etcd revokes an
// expired lease up to about half a second late (its lessor looks for them
// every 500 ms); never shorter. List and a refused acquire's HeldError
// report such a key held by its owner until the later of the two ends;
// renewals report at least the hold's end when this Backend made the
// grant. Renewals keep the holder's etcd lease alive only: the hold's
// runs out by itself. A holder whose own etcd lease ran out inside its
// min hold (its guard ended at its local deadline first) is told its
// lease expired on a later renewal (and its release returns that loss),
// although the key stays taken until the hold ends: the safe side.
// Waiters are woken by the holder key's deletion, and poll for the end of
// a hold (they sleep at most its remaining time).
//
// # Renewal, and an etcd bug it does not rely on
//
// A renewal sends a keep-alive on the etcd lease that the holder key was
// last seen on (its send time starts the new period, and the local
// deadline), and then checks, in a linearizable read-only transaction,
// that the holder key still carries the lease's token on that same etcd
// lease. Only both together are a renewal: a keep-alive that restarted a
// lease with no key under it, or the wrong lease, renews nothing.
//
// The check comes after the keep-alive, not before, because of an etcd
// server bug: a keep-alive racing the revocation of an expired lease can
// be answered with a positive TTL after the lease's keys were deleted
// (etcd-io/etcd#20547, fixed by etcd-io/etcd#20590 and backported to the
// 3.4, 3.5 and 3.6 branches in 2025: check your release's changelog for
// it). Every release before those backports lacks it, Debian's 3.4.23
// included. On such a server a check made before the
// keep-alive could pass, the key be deleted, another process be granted
// it, and the keep-alive still answer: two holders. The read after the
// keep-alive sees the deletion, so the backend is safe on both kinds of
// server, at no extra round trip.
//
// # Round trips
//
// TryAcquire: 1 round trip of latency on a spare etcd lease (one this
// Backend granted ahead, in the background, when its spares of a TTL in
// use run low, or one that a release or a refusal left): the spare's
// keep-alive and the transaction sent together (2 requests), the period
// dated from the keep-alive's send time, after the acquire was sent. A
// keep-alive is never sent on a lease just granted (an etcd 3.4 leader
// that has not applied the grant yet may answer it with TTL 0:
// etcd-io/etcd#13675): a spare granted within the last second is left for
// later. An acquire whose spare's renewal is not known (the keep-alive
// failed, found the lease gone, or was answered later than the spare's TTL
// could have ended: etcd-io/etcd#20547) is no grant on the spare, whatever
// its transaction did: it is sent once more, as the owner's repeat, on an
// etcd lease granted for it (a lease grant and one or two transactions
// more), so a spare that expired while etcd was slow never fails an
// acquire etcd can grant. With no spare at hand: 2 (lease grant, then the
// transaction); 3 when another
// process changed the key since this Backend last saw it; a refused attempt
// on a key this Backend saw held costs a read and the holder's
// time-to-live, and no write. With a MinHold, TryAcquire sends its two
// lease grants at the same time: 3 requests, still 2 round trips of
// latency, and a refusal by a min hold asks for the hold's time-to-live
// too. TryRenew: 2 (the keep-alive, then the
// read-only check); 3 on a Backend that has not seen the holder's etcd
// lease (it reads it first); a renewal with a longer TTL than the lease
// was granted with grants a new etcd lease, moves the holder onto it in a
// transaction and revokes the old one (4). TryRenewBatch (the Client
// renews through it): one keep-alive per lease, all pipelined on the
// Backend's keep-alive stream, then one read-only transaction that checks
// every lease, as nested transactions of at most [Options.MaxTxnOps] − 3
// leases each (etcd counts a nested transaction's operations against what
// its parent leaves); longer TTLs get new etcd leases, moved in
// transactions split the same way. Release: 1. Group commit: while four
// grants (an acquire's transaction, without a min hold) of a Backend are
// in flight, further concurrent ones queue and go together, one nested
// transaction each, in one transaction (one raft entry) when the first of
// those in flight is answered; releases likewise, in batches of their own.
// One call per key in a batch, a batch within [Options.MaxTxnOps]; a call
// whose nested transaction failed changed nothing and is sent again alone,
// so each gets the single call's answer. List: 1, plus one
// time-to-live per held key that this Backend did not grant or renew last
// (for those it reports the Deadline it reported), and one per min hold
// it did not grant. Only grants, releases and lease grants are
// raft writes; the renew check is a linearizable read and the keep-alive
// is served by the leader alone.
//
// Every keep-alive of a Backend (a renewal's, and an acquire's that reuses
// a spare etcd lease) is one request on one lease keep-alive stream that
// the Backend opens on first use and again after it breaks, for as long as
// the etcd client lives; replies are matched to requests by lease ID, and
// each request's send time, taken before it is sent, dates the period it
// starts. A keep-alive whose caller gives up within 250 ms fails alone:
// its request stays queued and takes its own late reply. One whose caller
// waited longer sheds the stream (stuck on a connection that no longer
// answers, or so far behind that its replies come too late): the requests
// on it that are still waited for are sent again on a new stream, those
// given up are dropped. A stream that answers nothing for 2 s while
// requests wait on it is ended, every request on it failing as transient.
// Not the etcd client's Lease.KeepAlive, which renews on its own clock and
// dates a lease from the reply.
//
// With several endpoints, the stream is opened on the leader's (the one
// of the client's endpoints whose Status names itself leader), on a
// connection of its own: a follower answers a stream's keep-alives one at
// a time, forwarding each to the leader, which on three members made a
// Backend 2.2 times slower at 64 goroutines and lost leases that the
// leader kept. A reply of a later raft term (an election) sheds the
// stream, so that the next one follows the leader; one opened when no
// member answered as the leader (an election under way, the leader's
// endpoint down) is shed after 10 s to look again. Give the client every
// member's endpoint: with one endpoint (or a load balancer's address) the
// stream goes wherever the client's connection does.
//
// TryAcquirePermit: 1 round trip of latency as TryAcquire (the
// transaction is a chain of nested grants, one per candidate permit: see
// permit.go), 2 when a candidate this Backend saw free was taken elsewhere
// and no other candidate was free; a refusal asks each holder's
// time-to-live, at once. TryAcquireAll: 1 round trip of latency (one
// transaction; an etcd lease, or a spare's keep-alive, per key, sent
// together), 2 when a key changed since this Backend saw it; a refusal
// asks the refusing holder's time-to-live. A set is at most
// [Options.MaxTxnOps] / 3 keys: etcd counts compares as operations.
//
// # Fencing
//
// [Backend.Fenced] applies the caller's etcd operations in one transaction
// that commits only while the lease holds its key: the counterpart of the
// PostgreSQL backend's FencedTx, for a resource kept in the same etcd.
package etcd
