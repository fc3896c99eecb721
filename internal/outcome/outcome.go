// Package outcome is the vocabulary in which every dialect says what became
// of an operation whose request failed: the names of the operations, which
// of them leave an outcome that matters unknown when they fail in flight,
// and the errors for a request that was never sent and for one that failed
// in flight.
//
// The three outcomes a failed request can have:
//
//   - not sent: nothing reached the backend, nothing was applied
//     ([Dialect.NotSent]). When the caller's context had ended, the error
//     wraps the context's error and matches neither
//     [sqllock.ErrUnavailable] nor [sqllock.ErrIndeterminate]: the caller
//     gave up, the backend did not fail. Otherwise (a connection could not
//     be had) it matches [sqllock.ErrUnavailable].
//   - refused: the backend answered with an error, and applied nothing;
//     each dialect names those errors itself.
//   - in flight: the request was sent and then the context ended or the
//     connection broke before the reply ([Dialect.InFlight]): for an
//     operation whose effect matters ([Op.Indeterminate]) the error matches
//     [sqllock.ErrIndeterminate], for the others [sqllock.ErrUnavailable]
//     (repeating them is safe).
//
// Why "not sent" is not [sqllock.ErrUnavailable]: the client's Acquire,
// when its wait ends while an attempt is queued or waiting for a
// connection, keeps the holder's refusal from the attempt before
// ([sqllock.ErrNotAcquired]) only for an error that is the context's alone,
// and its observer reports the call as timed out or canceled rather than
// as a backend failure.
package outcome

import (
	"fmt"

	"github.com/ashlock/ashlock/sqllock"
)

// Op names a backend operation in errors.
type Op string

// The operations of the dialects.
const (
	Acquire     Op = "acquire"
	AcquireRead Op = "acquire (read)" // the read-only part of an acquire (etcd)
	Grant       Op = "lease grant"    // an etcd lease of its own: no lock changes
	Renew       Op = "renew"
	Release     Op = "release"
	List        Op = "list"
	// Reap deletes ended keys; repeating it is harmless, so a failure in
	// flight is merely unavailable.
	Reap Op = "reap"
	// Compact moves live rows and rebuilds indexes; no row changes its
	// content, so a failure in flight is merely unavailable.
	Compact Op = "compact"
	// Fence starts a fenced transaction: it checks the lease and changes
	// nothing of the caller's.
	Fence Op = "fenced transaction"
	// Commit applies a fenced transaction's writes (etcd's fenced
	// transaction is one request that checks and commits at once: Commit).
	Commit Op = "fenced transaction commit"
)

// Indeterminate reports whether a failure in flight leaves the caller
// unable to tell whether o took effect, in a way that matters: a grant, a
// release or the caller's fenced writes may have been applied. A renew keeps
// the token, so repeating it is safe and a failed renew is merely
// unavailable; a lease grant alone changes no lock (an unused etcd lease
// expires by itself); reads and the start of a fenced transaction change
// nothing.
func (o Op) Indeterminate() bool {
	return o == Acquire || o == Release || o == Commit
}

// Unknown is the sentinel of o's outcome when it cannot be known:
// [sqllock.ErrIndeterminate] when o is indeterminate, else
// [sqllock.ErrUnavailable].
func (o Op) Unknown() error {
	if o.Indeterminate() {
		return sqllock.ErrIndeterminate
	}
	return sqllock.ErrUnavailable
}

// Read is the name of o's read-only part: AcquireRead for Acquire, o for
// the others.
func (o Op) Read() Op {
	if o == Acquire {
		return AcquireRead
	}
	return o
}

// Dialect is the prefix of a dialect's errors, such as "sqllock/postgres".
type Dialect string

// Prefix is the start of an error about operation o on key.
func (d Dialect) Prefix(o Op, key string) string {
	return fmt.Sprintf("%s: %s %q", d, o, key)
}

// NotSent is the error of operation o on key whose request was never sent
// (err says why): nothing was applied. ctxEnded says that the caller's
// context had ended: then the error is err's (the context's) and matches
// neither [sqllock.ErrUnavailable] nor [sqllock.ErrIndeterminate];
// otherwise the backend could not be reached, and it matches
// [sqllock.ErrUnavailable].
func (d Dialect) NotSent(o Op, key string, ctxEnded bool, err error) error {
	if ctxEnded {
		return fmt.Errorf("%s: not sent: %w", d.Prefix(o, key), err)
	}
	return fmt.Errorf("%s: %w: the request could not be sent, not applied: %w", d.Prefix(o, key), sqllock.ErrUnavailable, err)
}

// InFlight is the error of operation o on key whose request was sent and
// then got no reply: the caller's context ended meanwhile (ctxEnded), or
// the connection broke. For an indeterminate o it matches
// [sqllock.ErrIndeterminate] (and, for a broken connection,
// [sqllock.ErrUnavailable] too: the backend may be down); for the others
// [sqllock.ErrUnavailable] alone.
func (d Dialect) InFlight(o Op, key string, ctxEnded bool, err error) error {
	p := d.Prefix(o, key)
	switch {
	case ctxEnded && o.Indeterminate():
		return fmt.Errorf("%s: %w: the context ended while the request was in flight, and it may have committed: %w",
			p, sqllock.ErrIndeterminate, err)
	case ctxEnded:
		return fmt.Errorf("%s: %w: the context ended while the request was in flight: %w", p, sqllock.ErrUnavailable, err)
	case o.Indeterminate():
		return fmt.Errorf("%s: %w: %w: the connection failed after the request was sent, and it may have committed: %w",
			p, sqllock.ErrIndeterminate, sqllock.ErrUnavailable, err)
	}
	return fmt.Errorf("%s: %w: the connection failed: %w", p, sqllock.ErrUnavailable, err)
}
