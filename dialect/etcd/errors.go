package etcd

import (
	"context"
	"errors"
	"fmt"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// etc names etcd's errors in the dialects' one vocabulary of outcomes
// (operations, not sent, in flight).
const etc = outcome.Dialect("sqllock/etcd")

// notSent is the error of an operation whose request was never sent
// because the caller's context had ended: nothing was applied.
func notSent(o outcome.Op, key string, err error) error {
	return etc.NotSent(o, key, true, err)
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
func translate(ctx context.Context, o outcome.Op, key string, err error) error {
	for _, r := range rejected {
		if errors.Is(err, r) {
			return fmt.Errorf("%s: %w: refused by etcd, not applied: %w", etc.Prefix(o, key), sqllock.ErrUnavailable, err)
		}
	}
	if notConnected(err) {
		// No connection to any endpoint: nothing reached a server.
		return etc.NotSent(o, key, false, err)
	}
	ctxEnded := ctx.Err() != nil
	if !ctxEnded && !transient(err) {
		// The server answered with a permanent error (permission denied,
		// request too large, ...): nothing was applied.
		return fmt.Errorf("%s: %w", etc.Prefix(o, key), err)
	}
	return etc.InFlight(o, key, ctxEnded, err)
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
