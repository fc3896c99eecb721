package etcd

import (
	"context"
	"errors"
	"fmt"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ashlock/ashlock/sqllock"
)

// op names a backend operation in errors, and says whether a failure after
// the request was sent leaves its outcome unknown to the caller.
type op string

const (
	opAcquire     op = "acquire"
	opAcquireRead op = "acquire (read)"
	opGrant       op = "lease grant"
	opRenew       op = "renew"
	opRelease     op = "release"
	opList        op = "list"
	opFence       op = "fenced transaction"
)

// indeterminate reports whether a failure in flight leaves the caller
// unable to tell whether o took effect, in a way that matters: a grant, a
// release or the caller's fenced writes may have been applied. A renew
// keeps the token, so repeating it is safe and a failed renew is merely
// unavailable; a lease grant alone changes no lock (an unused etcd lease
// expires by itself); reads change nothing.
func (o op) indeterminate() bool {
	return o == opAcquire || o == opRelease || o == opFence
}

// read is the name of o's read-only part.
func (o op) read() op {
	if o == opAcquire {
		return opAcquireRead
	}
	return o
}

// notSent wraps the error of a context that had ended before a request was
// sent: the operation was not applied.
func notSent(o op, key string, err error) error {
	return fmt.Errorf("sqllock/etcd: %s %q: not sent: %w", o, key, err)
}

// rejected are the etcd errors with which a server refuses a request
// before applying anything: transient, and the outcome is known.
var rejected = []error{
	rpctypes.ErrNoLeader,
	rpctypes.ErrTooManyRequests,
	rpctypes.ErrNotCapable,
	rpctypes.ErrUnhealthy,
	rpctypes.ErrNoSpace,
	rpctypes.ErrLeaseNotFound, // a put with a lease that expired: the transaction failed whole
}

// translate turns an etcd client error into the sqllock error that
// describes it, once, at the backend boundary, wrapping the original.
func translate(ctx context.Context, o op, key string, err error) error {
	prefix := fmt.Sprintf("sqllock/etcd: %s %q", o, key)
	for _, r := range rejected {
		if errors.Is(err, r) {
			return fmt.Errorf("%s: %w: refused by etcd, not applied: %w", prefix, sqllock.ErrUnavailable, err)
		}
	}
	if notConnected(err) {
		return fmt.Errorf("%s: %w: no connection to etcd, not sent: %w", prefix, sqllock.ErrUnavailable, err)
	}
	ctxEnded := ctx.Err() != nil
	if !ctxEnded && !transient(err) {
		// The server answered with a permanent error (permission denied,
		// request too large, ...): nothing was applied.
		return fmt.Errorf("%s: %w", prefix, err)
	}
	switch {
	case o.indeterminate() && ctxEnded:
		return fmt.Errorf("%s: %w: the context ended while the request was in flight, and it may have been applied: %w",
			prefix, sqllock.ErrIndeterminate, err)
	case o.indeterminate():
		return fmt.Errorf("%s: %w: %w: the request failed in flight, and it may have been applied: %w",
			prefix, sqllock.ErrIndeterminate, sqllock.ErrUnavailable, err)
	case ctxEnded:
		return fmt.Errorf("%s: %w: the context ended while the request was in flight: %w", prefix, sqllock.ErrUnavailable, err)
	default:
		return fmt.Errorf("%s: %w: %w", prefix, sqllock.ErrUnavailable, err)
	}
}

// notConnected reports the client's own "not sent" errors: no connection
// to any endpoint, so nothing reached a server.
func notConnected(err error) bool {
	desc := rpctypes.ErrorDesc(err)
	return desc == "there is no address available" || desc == "there is no connection available"
}

// transient reports errors after which the request may have reached a
// server (and so may have been applied, for a write): gRPC's Unavailable
// (connection broke, server stopping, request timed out in raft, leader
// changed), DeadlineExceeded, Canceled, Internal and Unknown, and any error
// that is not a gRPC status at all.
func transient(err error) bool {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return true
	}
	var ee rpctypes.EtcdError
	if errors.As(err, &ee) {
		switch ee.Code() {
		case codes.Unavailable, codes.DeadlineExceeded, codes.Canceled, codes.Internal, codes.Unknown:
			return true
		}
		return false
	}
	st, ok := status.FromError(err)
	if !ok {
		return true
	}
	switch st.Code() {
	case codes.Unavailable, codes.DeadlineExceeded, codes.Canceled, codes.Internal, codes.Unknown, codes.Aborted:
		return true
	}
	return false
}
