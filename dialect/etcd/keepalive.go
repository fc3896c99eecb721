package etcd

import (
	"context"
	"errors"
	"fmt"
	"sync"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// keepAlives is a Backend's one lease keep-alive stream, opened on first
// use and again after it breaks, for as long as the etcd client lives.
// Each keep-alive is one request on it, matched to its reply by lease ID:
// etcd answers a stream's requests in order, so the replies for one lease
// come in the order its requests were sent. A caller takes its send time
// before it calls [keepAlives.once], so the period that a reply reports
// began after it.
//
// Not the etcd client's own Lease.KeepAlive: that renews on a clock of
// its own and dates a lease's deadline from the reply (from the time a
// reply is received, not the request sent), which would put a holder's
// local deadline past etcd's expiry. KeepAliveOnce, which this replaces,
// opens a new gRPC stream for each call (about twice the cost of a
// request on an open one).
type keepAlives struct {
	cli *clientv3.Client

	mu  sync.Mutex // guards cur
	cur *kaStream  // nil: none open
}

// kaStream is one open keep-alive stream.
type kaStream struct {
	stream pb.Lease_LeaseKeepAliveClient
	cancel context.CancelFunc

	sendMu sync.Mutex // serializes Send (a gRPC stream is not safe for concurrent sends)

	mu      sync.Mutex // guards waiting, err
	waiting map[int64][]chan kaReply
	err     error // set once the stream broke; no request is queued after
}

type kaReply struct {
	ttl int64 // seconds; <= 0: etcd does not know the lease
	err error
}

// errKeepAliveStream reports a keep-alive stream that ended under a
// request: the request may or may not have reached etcd. Transient.
var errKeepAliveStream = errors.New("the keep-alive stream ended")

// once sends one keep-alive for id and waits for its reply: the TTL etcd
// restarted the lease with (seconds), rpctypes.ErrLeaseNotFound when etcd
// does not know the lease, or the stream's or ctx's error.
func (k *keepAlives) once(ctx context.Context, id clientv3.LeaseID) (int64, error) {
	ttls, err := k.many(ctx, []clientv3.LeaseID{id})
	if err != nil {
		return 0, err
	}
	if ttls[0] <= 0 {
		return 0, rpctypes.ErrLeaseNotFound
	}
	return ttls[0], nil
}

// many sends one keep-alive for each of ids and waits for every reply: the
// TTLs etcd restarted the leases with (seconds; <= 0 for a lease etcd does
// not know), in order, or the stream's or ctx's error.
//
// A caller that gives up (ctx ended) ends the stream too: its requests'
// replies can then never be taken for a later request's (whose send time
// would date a renewal that happened before it), and the next request
// goes on a new stream, so that a stream stuck on a connection that no
// longer answers (half-open) is not used again. The other requests
// waiting on it fail as transient; a renewal is safe to repeat.
func (k *keepAlives) many(ctx context.Context, ids []clientv3.LeaseID) ([]int64, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	s, err := k.stream()
	if err != nil {
		return nil, err
	}
	chs := make([]chan kaReply, len(ids))
	s.mu.Lock()
	if s.err != nil {
		err := s.err
		s.mu.Unlock()
		return nil, err
	}
	for i, id := range ids {
		chs[i] = make(chan kaReply, 1)
		s.waiting[int64(id)] = append(s.waiting[int64(id)], chs[i])
	}
	// Queued and sent under the send lock, in the same order for one
	// lease: the order etcd answers in.
	s.sendMu.Lock()
	s.mu.Unlock()
	for _, id := range ids {
		if err = s.stream.Send(&pb.LeaseKeepAliveRequest{ID: int64(id)}); err != nil {
			break
		}
	}
	s.sendMu.Unlock()
	if err != nil {
		s.fail(k, err)
	}
	ttls := make([]int64, len(ids))
	for i, ch := range chs {
		select {
		case r := <-ch:
			if r.err != nil {
				return nil, r.err
			}
			ttls[i] = r.ttl
		case <-ctx.Done():
			s.fail(k, ctx.Err())
			return nil, ctx.Err()
		}
	}
	return ttls, nil
}

// stream returns the open stream, opening one if there is none.
func (k *keepAlives) stream() (*kaStream, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.cur != nil {
		return k.cur, nil
	}
	// The stream lives as long as the client does, or until it breaks;
	// with the leader required, a member that loses its leader ends it
	// rather than holding requests it cannot answer.
	ctx, cancel := context.WithCancel(clientv3.WithRequireLeader(k.cli.Ctx()))
	stream, err := pb.NewLeaseClient(k.cli.ActiveConnection()).LeaseKeepAlive(ctx)
	if err != nil {
		cancel()
		return nil, err
	}
	s := &kaStream{stream: stream, cancel: cancel, waiting: make(map[int64][]chan kaReply)}
	k.cur = s
	go s.recv(k)
	return s, nil
}

// recv hands each reply to the oldest request of its lease, until the
// stream breaks.
func (s *kaStream) recv(k *keepAlives) {
	for {
		resp, err := s.stream.Recv()
		if err != nil {
			s.fail(k, err)
			return
		}
		s.mu.Lock()
		q := s.waiting[resp.ID]
		if len(q) > 0 {
			q[0] <- kaReply{ttl: resp.TTL}
			if len(q) == 1 {
				delete(s.waiting, resp.ID)
			} else {
				s.waiting[resp.ID] = q[1:]
			}
		}
		s.mu.Unlock()
	}
}

// fail ends s after err: every request waiting on it gets the error, and
// the next request opens a new stream.
func (s *kaStream) fail(k *keepAlives, err error) {
	k.mu.Lock()
	if k.cur == s {
		k.cur = nil
	}
	k.mu.Unlock()
	s.cancel()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return
	}
	s.err = fmt.Errorf("%w: %w", errKeepAliveStream, rpctypes.Error(err))
	for id, q := range s.waiting {
		for _, ch := range q {
			ch <- kaReply{err: s.err}
		}
		delete(s.waiting, id)
	}
}
