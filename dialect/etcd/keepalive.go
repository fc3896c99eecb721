package etcd

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// keepAlives is a Backend's one lease keep-alive stream, opened on first
// use and again after it breaks, for as long as the etcd client lives.
// Each keep-alive is one request on it, matched to its reply by lease ID:
// etcd answers a stream's requests in order (its server handles them one
// at a time and answers each, or ends the stream), so the replies for one
// lease come in the order its requests were sent. A caller takes its send
// time before it calls [keepAlives.once], so the period that a reply
// reports began after it.
//
// Not the etcd client's own Lease.KeepAlive: that renews on a clock of
// its own and dates a lease's deadline from the reply (from the time a
// reply is received, not the request sent), which would put a holder's
// local deadline past etcd's expiry. KeepAliveOnce, which this replaces,
// opens a new gRPC stream for each call (about twice the cost of a
// request on an open one).
type keepAlives struct {
	cli *clientv3.Client
	// open, when set (by tests), opens a stream in place of cli.
	open func(ctx context.Context) (pb.Lease_LeaseKeepAliveClient, error)
	// stall is how long a stream may leave its requests without any
	// reply before it is failed (0: kaStall; tests set it).
	stall time.Duration

	mu  sync.Mutex // guards cur
	cur *kaStream  // nil: none open
}

// kaStall is how long a keep-alive stream may answer nothing while
// requests wait on it before it is taken as stuck (a half-open
// connection, a member whose server loop is blocked) and failed: every
// request waiting on it fails as transient, and the next one opens a new
// stream. A healthy etcd answers a keep-alive in well under a millisecond,
// and a busy stream answers something every few; half a second of silence
// is a stall, not a backlog. It is short beside etcd's shortest lease
// (2 s with etcd's defaults, renewed every 667 ms): a renewal stuck on
// the stream is retried on a new one with most of its lease still left.
const kaStall = 500 * time.Millisecond

// kaStream is one open keep-alive stream.
//
// Why a caller that gives up does not end the stream: its requests stay
// in their leases' queues, each with its buffered channel, and the reply
// to each is taken off the queue into that channel, which nobody reads.
// So a reply is never handed to a later request of its lease (whose send
// time would then date a renewal that happened before it was sent), and
// the other requests on the stream are left alone: one slow caller among
// thousands of keep-alives a second does not fail them all. Requests are
// queued only under sendMu and just before they are sent, in send order;
// a Send that fails ends the stream (a gRPC stream whose Send failed is
// finished), failing every request queued on it, those queued but never
// sent included, so no queue can keep a request that will get no reply
// on a stream still in use.
//
// What ends a stream instead: its Recv failing (etcd, the connection or
// the client ended it), a Send failing, or the stall watchdog: a stream
// with requests waiting and no reply at all for kaStall since the last
// reply (or since the first of them was sent, on a stream that had
// nothing in flight). A backlogged stream that answers is never failed,
// however long its oldest request has waited; a stuck one is failed within
// kaStall of its last sign of life, and its waiting requests with it. A
// Send blocked on a connection that takes nothing more (gRPC's flow
// control window full) holds sendMu, and the callers behind it, until
// then: its requests are queued, so they count as waiting, and ending the
// stream's context ends the Send.
//
// Rejected: failing the stream when a caller gives up and no reply came
// since its requests were sent. A caller with a deadline of a nanosecond
// gives up before any reply can come, on a healthy stream too, and a
// stream that is stuck but has no caller giving up is never failed.
type kaStream struct {
	stream pb.Lease_LeaseKeepAliveClient
	cancel context.CancelFunc
	stall  time.Duration

	sendMu sync.Mutex // serializes queueing and Send (a gRPC stream is not safe for concurrent sends); taken before mu

	mu       sync.Mutex // guards waiting, pending, progress, timer, armed, err
	waiting  map[int64][]chan kaReply
	pending  int         // requests queued and not yet answered (abandoned ones included)
	progress time.Time   // the last reply, or the send of the oldest request when none came since
	timer    *time.Timer // the stall watchdog
	armed    bool        // timer will fire (or is firing)
	err      error       // set once the stream broke; no request is queued after
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
// A caller that gives up (ctx ended) leaves its requests on the stream
// and the stream in use (see [kaStream]); a ctx that ended before they
// were queued sends none.
func (k *keepAlives) many(ctx context.Context, ids []clientv3.LeaseID) ([]int64, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	s, err := k.stream()
	if err != nil {
		return nil, err
	}
	chs := make([]chan kaReply, len(ids))
	// Queued and sent under the send lock, in the same order for one
	// lease: the order etcd answers in.
	s.sendMu.Lock()
	if err := ctx.Err(); err != nil {
		s.sendMu.Unlock()
		return nil, err
	}
	s.mu.Lock()
	if s.err != nil {
		err := s.err
		s.mu.Unlock()
		s.sendMu.Unlock()
		return nil, err
	}
	if s.pending == 0 {
		s.progress = time.Now()
	}
	s.pending += len(ids)
	if !s.armed {
		s.arm(k)
	}
	for i, id := range ids {
		chs[i] = make(chan kaReply, 1)
		s.waiting[int64(id)] = append(s.waiting[int64(id)], chs[i])
	}
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
	var ctx context.Context
	var cancel context.CancelFunc
	var stream pb.Lease_LeaseKeepAliveClient
	var err error
	if k.open != nil {
		ctx, cancel = context.WithCancel(context.Background())
		stream, err = k.open(ctx)
	} else {
		ctx, cancel = context.WithCancel(clientv3.WithRequireLeader(k.cli.Ctx()))
		stream, err = pb.NewLeaseClient(k.cli.ActiveConnection()).LeaseKeepAlive(ctx)
	}
	if err != nil {
		cancel()
		return nil, err
	}
	s := &kaStream{stream: stream, cancel: cancel, stall: cmp.Or(k.stall, kaStall), waiting: make(map[int64][]chan kaReply)}
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
		s.progress = time.Now()
		q := s.waiting[resp.ID]
		if len(q) > 0 {
			q[0] <- kaReply{ttl: resp.TTL}
			s.pending--
			if len(q) == 1 {
				delete(s.waiting, resp.ID)
			} else {
				s.waiting[resp.ID] = q[1:]
			}
		}
		s.mu.Unlock()
	}
}

// arm starts the stall watchdog, to fire s.stall after s.progress. s.mu
// is held.
func (s *kaStream) arm(k *keepAlives) {
	s.armed = true
	wait := s.stall - time.Since(s.progress)
	if s.timer == nil {
		s.timer = time.AfterFunc(wait, func() { s.watch(k) })
	} else {
		s.timer.Reset(wait)
	}
}

// watch is the stall watchdog: it fails s when requests have waited on it
// s.stall with no reply since, and otherwise sleeps until that could be
// so, or until a request is queued on an idle stream.
func (s *kaStream) watch(k *keepAlives) {
	s.mu.Lock()
	s.armed = false
	if s.err != nil || s.pending == 0 {
		s.mu.Unlock()
		return
	}
	silent, pending := time.Since(s.progress), s.pending
	if silent < s.stall {
		s.arm(k)
		s.mu.Unlock()
		return
	}
	s.mu.Unlock()
	s.fail(k, fmt.Errorf("no reply in %v with %d requests waiting", silent.Round(time.Millisecond), pending))
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
	if s.timer != nil {
		s.timer.Stop()
	}
	s.err = fmt.Errorf("%w: %w", errKeepAliveStream, rpctypes.Error(err))
	for id, q := range s.waiting {
		for _, ch := range q {
			ch <- kaReply{err: s.err}
		}
		delete(s.waiting, id)
	}
	s.pending = 0
}
