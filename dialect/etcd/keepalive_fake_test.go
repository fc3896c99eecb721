package etcd

import (
	"context"
	"errors"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"
	pb "go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

// fakeKA plays etcd's side of the keep-alive streams a [keepAlives]
// opens, in a synctest bubble: it records each stream's requests in the
// order they were sent, and either answers them itself, in order, one per
// delay (as etcd's server loop does), or leaves the answers to the test
// (delay < 0), in whatever order and with whatever TTLs it likes.
type fakeKA struct {
	delay time.Duration
	ttl   func(id int64) int64 // the TTL answered for a lease, when the fake answers
	// failSend, if set, is asked before each request is sent (n counts
	// the requests of all streams from 0) and fails its Send when true.
	failSend func(n int) bool

	mu      sync.Mutex // guards streams, n
	streams []*fakeKAStream
	n       int
}

type fakeKAStream struct {
	grpc.ClientStream // unused; nil
	f                 *fakeKA
	ctx               context.Context
	reqs              chan int64 // sent, for the fake's own answers
	replies           chan *pb.LeaseKeepAliveResponse

	mu   sync.Mutex // guards sent
	sent []int64
}

// newFakeKA returns keepAlives on f's streams, and a func that ends the
// open stream (call it before the bubble ends).
func newFakeKA(f *fakeKA) (*keepAlives, func()) {
	k := &keepAlives{open: f.open}
	return k, func() {
		k.mu.Lock()
		s := k.cur
		k.mu.Unlock()
		if s != nil {
			s.fail(k, errors.New("test over"))
		}
	}
}

func (f *fakeKA) open(ctx context.Context) (pb.Lease_LeaseKeepAliveClient, error) {
	s := &fakeKAStream{f: f, ctx: ctx, reqs: make(chan int64, 1<<14), replies: make(chan *pb.LeaseKeepAliveResponse, 1<<14)}
	f.mu.Lock()
	f.streams = append(f.streams, s)
	f.mu.Unlock()
	if f.delay >= 0 {
		go s.serve()
	}
	return s, nil
}

// opened returns how many streams were opened, and the last one.
func (f *fakeKA) opened() (int, *fakeKAStream) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.streams) == 0 {
		return 0, nil
	}
	return len(f.streams), f.streams[len(f.streams)-1]
}

// serve answers the stream's requests in order, one per delay.
func (s *fakeKAStream) serve() {
	for {
		select {
		case id := <-s.reqs:
			select {
			case <-time.After(s.f.delay):
				s.answer(id, s.f.ttl(id))
			case <-s.ctx.Done():
				return
			}
		case <-s.ctx.Done():
			return
		}
	}
}

func (s *fakeKAStream) answer(id, ttl int64) {
	s.replies <- &pb.LeaseKeepAliveResponse{ID: id, TTL: ttl}
}

// requests returns the lease IDs of the requests sent on s so far.
func (s *fakeKAStream) requests() []int64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]int64(nil), s.sent...)
}

func (s *fakeKAStream) Send(req *pb.LeaseKeepAliveRequest) error {
	s.f.mu.Lock()
	n := s.f.n
	s.f.n++
	s.f.mu.Unlock()
	if s.f.failSend != nil && s.f.failSend(n) {
		return errors.New("send failed")
	}
	s.mu.Lock()
	s.sent = append(s.sent, req.ID)
	s.mu.Unlock()
	if s.f.delay >= 0 {
		s.reqs <- req.ID
	}
	return nil
}

func (s *fakeKAStream) Recv() (*pb.LeaseKeepAliveResponse, error) {
	select {
	case r := <-s.replies:
		return r, nil
	case <-s.ctx.Done():
		return nil, s.ctx.Err()
	}
}

// kaResult is what one keep-alive call returned, and when.
type kaResult struct {
	ttl int64
	err error
	at  time.Time
}

// goOnce calls k.once(ctx, id) in a goroutine of wg and returns where its
// result will be.
func goOnce(wg *sync.WaitGroup, k *keepAlives, ctx context.Context, id int64) chan kaResult {
	ch := make(chan kaResult, 1)
	wg.Go(func() {
		ttl, err := k.once(ctx, clientv3.LeaseID(id))
		ch <- kaResult{ttl, err, time.Now()}
	})
	return ch
}

// TestKeepAliveGiveUpLeavesOthers: on a healthy stream, callers that give
// up before their replies, sooner than kaQuiet (deadlines of 1 ns to
// 200 ms), fail alone: every other keep-alive on the stream gets its own
// lease's reply, and the stream is the same one afterwards. The stream is
// backlogged (400 requests answered one per 6 ms: the last waits 2.4 s,
// more than the stall bound) yet answers all along, so the stall watchdog
// leaves it be.
func TestKeepAliveGiveUpLeavesOthers(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		f := &fakeKA{delay: 6 * time.Millisecond, ttl: func(id int64) int64 { return 100 + id }}
		k, end := newFakeKA(f)
		defer end()
		var wg sync.WaitGroup
		deadlines := []time.Duration{1, time.Millisecond, 2 * time.Millisecond, kaQuiet * 2 / 5, kaQuiet * 4 / 5}
		var patient, impatient []chan kaResult
		var ids []int64
		for i := range 400 {
			id := int64(1 + i%8)
			if i%2 == 0 {
				ctx, cancel := context.WithTimeout(context.Background(), deadlines[i/2%len(deadlines)])
				defer cancel()
				impatient = append(impatient, goOnce(&wg, k, ctx, id))
				continue
			}
			patient = append(patient, goOnce(&wg, k, context.Background(), id))
			ids = append(ids, id)
		}
		wg.Wait()
		gaveUp := 0
		for _, ch := range impatient {
			if r := <-ch; errors.Is(r.err, context.DeadlineExceeded) {
				gaveUp++
			}
		}
		require.Greater(t, gaveUp, 180, "callers that gave up before their reply")
		for i, ch := range patient {
			r := <-ch
			require.NoError(t, r.err, "patient caller %d (lease %d)", i, ids[i])
			require.Equal(t, 100+ids[i], r.ttl, "patient caller %d got another lease's reply", i)
		}
		n, s := f.opened()
		require.Equal(t, 1, n, "streams opened")
		require.Len(t, s.requests(), 400, "every request, abandoned or not, went on the one stream")
		ttl, err := k.once(context.Background(), 3)
		require.NoError(t, err)
		require.Equal(t, int64(103), ttl)
		n, _ = f.opened()
		require.Equal(t, 1, n, "the stream after the give-ups")
	})
}

// TestKeepAliveAbandonedReplyNotTakenByLater: a request whose caller gave
// up stays first in its lease's queue, so the reply to it is never handed
// to the lease's next request (whose send time would then date a renewal
// that happened before it was sent): each request gets its own reply.
func TestKeepAliveAbandonedReplyNotTakenByLater(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		f := &fakeKA{delay: -1}
		k, end := newFakeKA(f)
		defer end()
		var wg sync.WaitGroup
		gone, cancel := context.WithCancel(context.Background())
		first := goOnce(&wg, k, gone, 7)
		synctest.Wait() // sent, waiting for its reply
		cancel()
		r := <-first
		require.ErrorIs(t, r.err, context.Canceled)
		later := goOnce(&wg, k, context.Background(), 7)
		synctest.Wait()
		n, s := f.opened()
		require.Equal(t, 1, n, "streams opened")
		require.Equal(t, []int64{7, 7}, s.requests())
		s.answer(7, 111) // the abandoned request's
		s.answer(7, 222) // the later one's
		r = <-later
		require.NoError(t, r.err)
		require.Equal(t, int64(222), r.ttl, "the later request took the abandoned one's reply")
		wg.Wait()
	})
}

// TestKeepAliveStalledStreamFailed: a stream that stops answering (a
// half-open connection) while nobody gives up on it after kaQuiet is
// failed by the watchdog kaStall after its last reply: every request
// waiting on it then fails as transient, and the next keep-alive opens a
// new stream and gets its reply there.
func TestKeepAliveStalledStreamFailed(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		f := &fakeKA{delay: -1}
		k, end := newFakeKA(f)
		defer end()
		var wg sync.WaitGroup
		start := time.Now()
		bounded, cancel := context.WithTimeout(context.Background(), 20*kaStall)
		defer cancel()
		one := goOnce(&wg, k, bounded, 1)
		two := goOnce(&wg, k, bounded, 2)
		synctest.Wait()
		_, s := f.opened()
		time.Sleep(kaStall * 3 / 5)
		s.answer(1, 5) // the last sign of life
		r := <-one
		require.NoError(t, r.err)
		lastReply := time.Now()
		// A caller that gives up meanwhile, sooner than kaQuiet, ends
		// nothing.
		short, cancelShort := context.WithTimeout(context.Background(), kaQuiet/2)
		defer cancelShort()
		r = <-goOnce(&wg, k, short, 3)
		require.ErrorIs(t, r.err, context.DeadlineExceeded)
		n, _ := f.opened()
		require.Equal(t, 1, n, "a give-up ended the stream")

		r = <-two
		require.ErrorIs(t, r.err, errKeepAliveStream)
		require.Equal(t, kaStall, r.at.Sub(lastReply), "failed this long after the stream's last reply (started %v before)", lastReply.Sub(start))
		require.ErrorIs(t, translate(bounded, outcome.Renew, "k", r.err), sqllock.ErrUnavailable, "transient")

		next := goOnce(&wg, k, context.Background(), 2)
		synctest.Wait()
		n, s2 := f.opened()
		require.Equal(t, 2, n, "a new stream after the stalled one")
		require.Equal(t, []int64{2}, s2.requests())
		s2.answer(2, 9)
		r = <-next
		require.NoError(t, r.err)
		require.Equal(t, int64(9), r.ttl)
		wg.Wait()
	})
}

// TestKeepAliveSendFailsHalfway: a Send that fails in the middle of a
// call's keep-alives ends the stream at once, with the requests queued on
// it (those never sent included, which would otherwise take the replies
// of later requests): the call and every other request waiting on the
// stream fail as transient, without waiting, and the next keep-alive
// goes on a new stream and gets its own lease's reply.
func TestKeepAliveSendFailsHalfway(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		f := &fakeKA{delay: 10 * time.Millisecond, ttl: func(id int64) int64 { return 100 + id }, failSend: func(n int) bool { return n == 2 }}
		k, end := newFakeKA(f)
		defer end()
		var wg sync.WaitGroup
		start := time.Now()
		other := goOnce(&wg, k, context.Background(), 9)
		synctest.Wait()
		_, err := k.many(context.Background(), []clientv3.LeaseID{1, 2, 3})
		require.ErrorIs(t, err, errKeepAliveStream)
		require.Zero(t, time.Since(start), "the call waited after its Send failed")
		r := <-other
		require.ErrorIs(t, r.err, errKeepAliveStream, "another request on the failed stream")
		require.Zero(t, r.at.Sub(start))

		ttls, err := k.many(context.Background(), []clientv3.LeaseID{3, 1})
		require.NoError(t, err)
		require.Equal(t, []int64{103, 101}, ttls)
		n, s := f.opened()
		require.Equal(t, 2, n, "streams opened")
		require.Equal(t, []int64{3, 1}, s.requests())
		wg.Wait()
	})
}

// TestKeepAliveLateGiveUpMovesOthers: a caller that gives up after
// waiting kaQuiet sheds the stream (stuck, or too far behind): the
// requests on it whose callers still wait are sent again on a new stream,
// and get their replies there, while those given up are dropped; a reply
// on the old stream reaches nobody. One that gave up sooner (a shorter
// deadline) leaves the stream as it is.
func TestKeepAliveLateGiveUpMovesOthers(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		f := &fakeKA{delay: -1}
		k, end := newFakeKA(f)
		defer end()
		var wg sync.WaitGroup
		start := time.Now()
		bounded, cancel := context.WithTimeout(context.Background(), 20*kaStall)
		defer cancel()
		patient := goOnce(&wg, k, bounded, 1)
		synctest.Wait()
		soon, cancelSoon := context.WithTimeout(context.Background(), kaQuiet/2)
		defer cancelSoon()
		r := <-goOnce(&wg, k, soon, 2)
		require.ErrorIs(t, r.err, context.DeadlineExceeded)
		synctest.Wait()
		n, s1 := f.opened()
		require.Equal(t, 1, n, "a give-up before kaQuiet ended the stream")
		late, cancelLate := context.WithTimeout(context.Background(), kaQuiet)
		defer cancelLate()
		r = <-goOnce(&wg, k, late, 3)
		require.ErrorIs(t, r.err, context.DeadlineExceeded)
		synctest.Wait()
		n, s2 := f.opened()
		require.Equal(t, 2, n, "a new stream after the late give-up")
		require.Equal(t, []int64{1, 2, 3}, s1.requests())
		require.Equal(t, []int64{1}, s2.requests(), "sent again: the request whose caller waits, not those given up")
		s1.answer(1, 5) // too late: the old stream's reply
		s2.answer(1, 9)
		r = <-patient
		require.NoError(t, r.err)
		require.Equal(t, int64(9), r.ttl, "the reply on the new stream")
		require.Equal(t, kaQuiet/2+kaQuiet, r.at.Sub(start))
		wg.Wait()
	})
}

// TestKeepAliveLateGiveUpsLeaveOthers: on a stream far behind (400
// requests answered one per 6 ms), callers that give up late (300 to
// 600 ms) shed it again and again, and every caller that waits still gets
// its own lease's reply: nobody else fails.
func TestKeepAliveLateGiveUpsLeaveOthers(t *testing.T) {
	t.Parallel()
	synctest.Test(t, func(t *testing.T) {
		f := &fakeKA{delay: 6 * time.Millisecond, ttl: func(id int64) int64 { return 100 + id }}
		k, end := newFakeKA(f)
		defer end()
		var wg sync.WaitGroup
		deadlines := []time.Duration{kaQuiet + 50*time.Millisecond, kaQuiet + 150*time.Millisecond, kaQuiet + 350*time.Millisecond}
		var patient []chan kaResult
		var ids []int64
		for i := range 400 {
			id := int64(1 + i%8)
			if i%2 == 0 {
				ctx, cancel := context.WithTimeout(context.Background(), deadlines[i/2%len(deadlines)])
				defer cancel()
				goOnce(&wg, k, ctx, id)
				continue
			}
			patient = append(patient, goOnce(&wg, k, context.Background(), id))
			ids = append(ids, id)
		}
		wg.Wait()
		for i, ch := range patient {
			r := <-ch
			require.NoError(t, r.err, "patient caller %d (lease %d)", i, ids[i])
			require.Equal(t, 100+ids[i], r.ttl, "patient caller %d got another lease's reply", i)
		}
		n, _ := f.opened()
		require.Greater(t, n, 1, "streams opened: no late give-up shed the stream")
	})
}
