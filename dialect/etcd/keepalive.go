package etcd

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"
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
	// stall is the watchdog's bound for the streams opened after it is
	// set; 0: kaStall. A test that holds a reply back longer than
	// kaStall, to see what a late one does, raises it.
	stall time.Duration
	// seek is kaSeekLeader for the streams opened after it is set (0:
	// kaSeekLeader), and findLeader, when set (by tests), looks for the
	// leader's connection in place of leaderConn.
	seek       time.Duration
	findLeader func() (*grpc.ClientConn, uint64)

	mu  sync.Mutex // guards cur, home, homeEP, homeStop
	cur *kaStream  // nil: none open
	// home is the connection to the endpoint of etcd's leader that the
	// stream was last opened on (see [keepAlives.leaderConn]), homeEP that
	// endpoint; nil when the stream is on the client's own connection.
	home     *grpc.ClientConn
	homeEP   string
	homeStop func() bool // stops home's close at the client's end
}

// kaFindLeader bounds the Status calls that look for the leader's
// endpoint when a stream is opened.
const kaFindLeader = time.Second

// kaSeekLeader is how long a stream of a client with several endpoints
// that was opened without finding the leader (a cluster electing, the
// leader's endpoint missing or down) is kept before it is shed, at its
// next reply, so that the next stream looks for the leader again.
const kaSeekLeader = 10 * time.Second

// leaderConn returns a connection to the endpoint, among the client's
// own, of etcd's leader, dialled once and kept while the leader stays
// there, and the raft term that leader answered with; nil when the client
// has one endpoint, or when none answers as the leader in time (a load
// balancer's address, a cluster electing): then the stream goes on the
// client's connection, as it does with one endpoint. k.mu is held.
//
// etcd answers a stream's keep-alives one at a time, and a member that is
// not the leader forwards each to the leader (an HTTP request between
// members) and waits for its answer before it reads the next. The etcd
// client puts a stream on any of its endpoints, so on three members two
// starts in three put it on a follower. Measured on three members on two
// cores (a fresh cluster, the client given all three endpoints): with the
// stream on a follower, acquire + release pairs ran 851/s at 64 goroutines
// (0.44x etcd's Mutex), and on the leader 1,899/s (1.21x); 10,000 leases
// at a 6 s TTL held through a follower lost 6,133 of them, and none with
// the stream on the leader. Eight streams on the follower instead did not
// help (the same pairs/s; 9,492 leases lost).
func (k *keepAlives) leaderConn() (*grpc.ClientConn, uint64) {
	eps := k.cli.Endpoints()
	if len(eps) < 2 {
		return nil, 0
	}
	ctx, cancel := context.WithTimeout(k.cli.Ctx(), kaFindLeader)
	defer cancel()
	type answer struct {
		ep   string
		term uint64 // 0: not the leader, or no answer
	}
	answers := make(chan answer, len(eps))
	for _, ep := range eps {
		go func() {
			st, err := k.cli.Status(ctx, ep)
			a := answer{ep: ep}
			if err == nil && st.Header != nil && st.Leader != 0 && st.Header.MemberId == st.Leader {
				a.term = st.RaftTerm
			}
			answers <- a
		}()
	}
	var leader answer
	for range eps {
		if a := <-answers; a.term != 0 {
			leader = a
			break
		}
	}
	if leader.term == 0 {
		return nil, 0
	}
	if k.home != nil && k.homeEP == leader.ep {
		return k.home, leader.term
	}
	conn, err := k.cli.Dial(leader.ep)
	if err != nil {
		return nil, 0
	}
	if k.home != nil {
		k.homeStop()
		k.home.Close()
	}
	k.home, k.homeEP = conn, leader.ep
	k.homeStop = context.AfterFunc(k.cli.Ctx(), func() { conn.Close() })
	return conn, leader.term
}

// kaStall is how long a keep-alive stream may answer nothing while
// requests wait on it before the watchdog takes it as stuck (a half-open
// connection, a member whose server loop is blocked) and fails it: every
// request waiting on it fails as transient, and the next one opens a new
// stream. A healthy etcd answers a keep-alive in well under a
// millisecond, but an alive one on a loaded host can fall silent for a
// while: 10,000 leases at a 6 s TTL (5,000 keep-alives a second) on two
// cores at a load of 24 had gaps of up to 480 ms between replies, with
// thousands waiting, and a bound of 500 ms failed it in both runs tried.
// The watchdog is the backstop for a stream on which nobody gives up
// late.
const kaStall = 2 * time.Second

// kaQuiet is how long a caller must have waited for its replies for its
// giving up to shed the stream (see [kaStream]). Below it (a deadline of a
// nanosecond, of a millisecond) a give-up says nothing of the stream: a
// healthy one takes that long to answer under load.
const kaQuiet = 250 * time.Millisecond

// kaStream is one open keep-alive stream.
//
// A caller that gives up sooner than kaQuiet fails alone: its requests
// stay in their leases' queues, each with its buffered channel, and the
// reply to each is taken off the queue into that channel, which nobody
// reads. So a reply is never handed to a later request of its lease
// (whose send time would then date a renewal that happened before it was
// sent), and the other requests on the stream are left alone. Requests
// are queued only while their caller holds send, and just before they
// are sent, in send order; a Send that fails ends the stream (a gRPC
// stream whose Send failed is finished), failing every request queued on
// it, those queued but never sent included, so no queue can keep a
// request that will get no reply on a stream still in use.
//
// A caller that gives up after waiting kaQuiet or more sheds the stream:
// it is stuck (half-open), or so far behind that its replies come after
// their callers stop waiting. Keeping such a stream was tried, and it
// collapsed: etcd still answers each abandoned request, one at a time,
// and the retries of the callers that gave up queue behind them, so the
// backlog only grows: 10,000 leases at a 6 s TTL (5,000 keep-alives a
// second) on two cores at loads of 14 to 30 lost 73% to 89% of them in
// each of three runs. Failing every request on the stream instead (the
// rule before) sheds the backlog but refuses every acquire in flight on
// it. So the stream is ended and its requests whose callers still wait
// are sent again, in their order, on a new stream, which has no backlog;
// those given up are dropped. That is safe: a request sent again is sent
// after its caller took its send time, so the renewal its reply reports
// began after that time too, and it is matched on the new stream as any
// request is.
//
// The stall watchdog fails a stream on which nobody gives up: requests
// waiting and no reply at all for kaStall since the last reply (or since
// the first of them was sent, on a stream that had nothing in flight);
// every request waiting on it fails as transient, and the next one opens
// a new stream. A backlogged stream that answers is not failed by it,
// however long its oldest request has waited. A caller waits for send
// only as long as its ctx lasts; a Send blocked on a connection that
// takes nothing more (gRPC's flow control window full) holds send until
// the stream is failed or shed, which ends the Send.
type kaStream struct {
	stream pb.Lease_LeaseKeepAliveClient
	cancel context.CancelFunc
	stall  time.Duration // the watchdog's bound (kaStall)
	// follows is set for a stream of a client with several endpoints; term
	// is the raft term the leader answered with when the stream was
	// opened on its endpoint, 0 when no leader was found (the stream is on
	// the client's connection) until its first reply. A reply of a later
	// term means an election, which may have moved the leader: the stream
	// is shed, and the next one is opened where the leader is now. A
	// stream opened without the leader is shed at its first reply after
	// kaSeekLeader, to look for it again.
	follows    bool
	term       uint64
	leaderless bool
	opened     time.Time
	seek       time.Duration // kaSeekLeader

	// send is held (a value in it) by the caller that queues and sends
	// its requests: a gRPC stream is not safe for concurrent sends, and
	// the order of the queues is the order of the sends. Taken before mu.
	send chan struct{}

	mu       sync.Mutex // guards waiting, pending, progress, timer, armed, err
	waiting  map[int64][]*kaReq
	pending  int         // requests queued and not yet answered (abandoned ones included)
	progress time.Time   // the last reply, or the send of the oldest request when none came since
	timer    *time.Timer // the stall watchdog
	armed    bool        // timer will fire (or is firing)
	err      error       // set once the stream broke; no request is queued after
}

// kaReq is one request waiting for its reply.
type kaReq struct {
	ch   chan kaReply // takes the reply; buffered, one
	gone atomic.Bool  // its caller gave up
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
// A caller that gives up (ctx ended) sooner than kaQuiet leaves its
// requests on the stream and the stream in use; later, it sheds the
// stream (see [kaStream]). A ctx that ended before they were queued sends
// none.
func (k *keepAlives) many(ctx context.Context, ids []clientv3.LeaseID) ([]int64, error) {
	if len(ids) == 0 {
		return nil, nil
	}
	reqs := make([]*kaReq, len(ids))
	lids := make([]int64, len(ids))
	for i, id := range ids {
		reqs[i], lids[i] = &kaReq{ch: make(chan kaReply, 1)}, int64(id)
	}
	s, at, err := k.queue(ctx, lids, reqs)
	if err != nil {
		return nil, err
	}
	ttls := make([]int64, len(ids))
	for i, r := range reqs {
		select {
		case rep := <-r.ch:
			if rep.err != nil {
				return nil, rep.err
			}
			ttls[i] = rep.ttl
		case <-ctx.Done():
			for _, r := range reqs[i:] {
				r.gone.Store(true)
			}
			s.gaveUp(k, at)
			return nil, ctx.Err()
		}
	}
	return ttls, nil
}

// queue queues reqs, the requests for ids, on the open stream and sends
// them (see [kaStream.queue]), opening a stream if there is none; a
// stream that ended before they were queued (nothing of them sent) is
// replaced, a few times at most.
func (k *keepAlives) queue(ctx context.Context, ids []int64, reqs []*kaReq) (*kaStream, time.Time, error) {
	var err error
	for range 3 {
		var s *kaStream
		if s, err = k.stream(); err != nil {
			break
		}
		var at time.Time
		if at, err = s.queue(ctx, k, ids, reqs); err == nil {
			return s, at, nil
		}
		if !errors.Is(err, errKeepAliveStream) {
			break // ctx ended
		}
	}
	return nil, time.Time{}, err
}

// queue queues reqs, the requests for ids, on s and sends them, in that
// order, holding send (waited for as long as ctx lasts); it returns when
// it queued them. A Send that fails fails s. An error means none is
// queued.
func (s *kaStream) queue(ctx context.Context, k *keepAlives, ids []int64, reqs []*kaReq) (time.Time, error) {
	select {
	case s.send <- struct{}{}:
	case <-ctx.Done():
		return time.Time{}, ctx.Err()
	}
	defer func() { <-s.send }()
	if err := ctx.Err(); err != nil {
		return time.Time{}, err
	}
	s.mu.Lock()
	if s.err != nil {
		err := s.err
		s.mu.Unlock()
		return time.Time{}, err
	}
	at := time.Now()
	if s.pending == 0 {
		s.progress = at
	}
	s.pending += len(ids)
	if !s.armed {
		s.arm(k)
	}
	for i, id := range ids {
		s.waiting[id] = append(s.waiting[id], reqs[i])
	}
	s.mu.Unlock()
	for _, id := range ids {
		if err := s.stream.Send(&pb.LeaseKeepAliveRequest{ID: id}); err != nil {
			s.fail(k, err)
			break
		}
	}
	return at, nil
}

// gaveUp is told by a caller that gave up on its requests, queued at at.
// It sheds s when the caller waited kaQuiet or more (see [kaStream]).
func (s *kaStream) gaveUp(k *keepAlives, at time.Time) {
	if waited := time.Since(at); waited >= kaQuiet {
		s.shed(k, fmt.Errorf("no reply in %v, when its caller gave up", waited.Round(time.Millisecond)))
	}
}

// shed ends s after err, and sends its requests whose callers still wait
// again, in their order for each lease, on a new stream (see [kaStream]).
func (s *kaStream) shed(k *keepAlives, err error) {
	ids, reqs := s.end(k, err, false)
	if len(reqs) == 0 {
		return
	}
	go func() {
		if _, _, err := k.queue(context.Background(), ids, reqs); err != nil {
			if !errors.Is(err, errKeepAliveStream) {
				err = fmt.Errorf("%w: %w", errKeepAliveStream, rpctypes.Error(err))
			}
			for _, r := range reqs {
				r.ch <- kaReply{err: err}
			}
		}
	}()
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
	follows, term := false, uint64(0)
	if k.open != nil {
		ctx, cancel = context.WithCancel(context.Background())
		stream, err = k.open(ctx)
	} else {
		ctx, cancel = context.WithCancel(clientv3.WithRequireLeader(k.cli.Ctx()))
		conn := k.cli.ActiveConnection()
		find := k.leaderConn
		if k.findLeader != nil {
			find = k.findLeader
		}
		if home, t := find(); home != nil {
			conn, term = home, t
		}
		follows = len(k.cli.Endpoints()) > 1
		stream, err = pb.NewLeaseClient(conn).LeaseKeepAlive(ctx)
	}
	if err != nil {
		cancel()
		return nil, err
	}
	s := &kaStream{stream: stream, cancel: cancel, stall: cmp.Or(k.stall, kaStall), follows: follows, term: term, leaderless: follows && term == 0, opened: time.Now(), seek: cmp.Or(k.seek, kaSeekLeader), send: make(chan struct{}, 1), waiting: make(map[int64][]*kaReq)}
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
		if s.follows && resp.Header != nil {
			var why error
			switch {
			case s.term == 0:
				s.term = resp.Header.RaftTerm
			case resp.Header.RaftTerm > s.term:
				why = fmt.Errorf("raft term %d after %d: the leader may have moved", resp.Header.RaftTerm, s.term)
			}
			if why == nil && s.leaderless && time.Since(s.opened) >= s.seek {
				why = errors.New("opened without the leader; looking for it again")
			}
			if why != nil {
				s.handOut(resp)
				s.shed(k, why)
				return
			}
		}
		s.handOut(resp)
	}
}

// handOut hands resp to the oldest request of its lease.
func (s *kaStream) handOut(resp *pb.LeaseKeepAliveResponse) {
	s.mu.Lock()
	s.progress = time.Now()
	q := s.waiting[resp.ID]
	if len(q) > 0 {
		q[0].ch <- kaReply{ttl: resp.TTL}
		s.pending--
		if len(q) == 1 {
			delete(s.waiting, resp.ID)
		} else {
			s.waiting[resp.ID] = q[1:]
		}
	}
	s.mu.Unlock()
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
func (s *kaStream) fail(k *keepAlives, err error) { s.end(k, err, true) }

// end ends s after err: the next request opens a new stream, and every
// request waiting on s gets the error (fail), or is taken off s and,
// unless its caller gave up, returned in ids and reqs, in its lease's
// order (!fail). Once s has ended, end does nothing.
//
// s's context is cancelled only after s.err is set: the cancel ends the
// stream's Recv, and its reader then fails s; had that fail come first,
// it would have failed the requests a shed is moving to a new stream
// (seen as TestKeepAliveLateGiveUpMovesOthers failing now and then).
func (s *kaStream) end(k *keepAlives, err error, fail bool) (ids []int64, reqs []*kaReq) {
	k.mu.Lock()
	if k.cur == s {
		k.cur = nil
	}
	k.mu.Unlock()
	defer s.cancel()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.err != nil {
		return nil, nil
	}
	if s.timer != nil {
		s.timer.Stop()
	}
	s.err = fmt.Errorf("%w: %w", errKeepAliveStream, rpctypes.Error(err))
	for id, q := range s.waiting {
		for _, r := range q {
			switch {
			case fail:
				r.ch <- kaReply{err: s.err}
			case !r.gone.Load():
				ids, reqs = append(ids, id), append(reqs, r)
			}
		}
		delete(s.waiting, id)
	}
	s.pending = 0
	return ids, reqs
}
