package election_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/ashlock/ashlock/election"
	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

const ttl = 3 * time.Second

// releases counts the releases a backend receives.
type releases struct {
	*memory.Backend
	n atomic.Int64
}

func (r *releases) Release(ctx context.Context, l sqllock.Lease) error {
	r.n.Add(1)
	return r.Backend.Release(ctx, l)
}

func candidate(t *testing.T, b sqllock.Backend, name string) *election.Election {
	t.Helper()
	c, err := sqllock.New(b, sqllock.Options{TTL: ttl, Owner: name, Backoff: func(int) time.Duration { return 50 * time.Millisecond }})
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close(context.Background()) })
	e, err := election.New(c, election.Config{Name: "scheduler", Value: []byte("addr-" + name), Backoff: func(int) time.Duration { return 100 * time.Millisecond }, PollInterval: 200 * time.Millisecond})
	require.NoError(t, err)
	return e
}

func TestNewValidates(t *testing.T) {
	c, err := sqllock.New(memory.New(), sqllock.Options{})
	require.NoError(t, err)
	for _, cfg := range []election.Config{{}, {Name: "a\x00b"}, {Name: "x", TTL: time.Nanosecond}, {Name: "x", PollInterval: -1}, {Name: "x", Value: make([]byte, sqllock.MaxValueLen+1)}} {
		_, err := election.New(c, cfg)
		require.Error(t, err, "%+v", cfg)
	}
	_, err = election.New(nil, election.Config{Name: "x"})
	require.Error(t, err)
	e, err := election.New(c, election.Config{Name: "x"})
	require.NoError(t, err)
	require.Equal(t, "election/x", e.Key())
}

// One leader at a time; the next term's number is greater; Leader reports
// the holder, then no leader.
func TestCampaignResignTakeover(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memory.New()
		a, b := candidate(t, mem, "a"), candidate(t, mem, "b")

		_, err := a.Leader(t.Context())
		require.ErrorIs(t, err, election.ErrNoLeader)

		la, err := a.Campaign(t.Context())
		require.NoError(t, err)
		require.EqualValues(t, 1, la.Term().Token)

		won := make(chan *election.Leadership)
		go func() {
			lb, err := b.Campaign(t.Context())
			if err != nil {
				t.Error(err)
			}
			won <- lb
		}()
		time.Sleep(5 * time.Second) // b waits while a leads (and renews)
		synctest.Wait()
		select {
		case <-won:
			t.Fatal("b became leader while a led")
		default:
		}
		cur, err := b.Leader(t.Context())
		require.NoError(t, err)
		require.Equal(t, la.Term().Token, cur.Token)
		require.Equal(t, la.Term().Leader, cur.Leader)
		require.Equal(t, []byte("addr-a"), la.Term().Value)
		require.Equal(t, []byte("addr-a"), cur.Value, "Leader reports the leader's value")

		require.NoError(t, la.Resign(t.Context()))
		require.ErrorIs(t, la.Err(), sqllock.ErrReleased)
		lb := <-won
		require.Greater(t, lb.Term().Token, la.Term().Token, "terms strictly increase")
		require.Equal(t, []byte("addr-b"), lb.Term().Value)
		require.NoError(t, lb.Resign(t.Context()))
		_, err = a.Leader(t.Context())
		require.ErrorIs(t, err, election.ErrNoLeader)
	})
}

// The context passed to Campaign bounds the campaign only: when it ends
// after the win, the leadership is not released under the leader.
func TestCampaignContextDoesNotEndLeadership(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := &releases{Backend: memory.New()}
		e := candidate(t, mem, "a")
		ctx, cancel := context.WithCancel(t.Context())
		l, err := e.Campaign(ctx)
		require.NoError(t, err)
		cancel()
		time.Sleep(2 * ttl) // renewals go on
		require.NoError(t, l.Err())
		require.Zero(t, mem.n.Load(), "nothing released")
		require.NoError(t, l.Resign(t.Context()))
		require.EqualValues(t, 1, mem.n.Load())
	})
}

// Run does not return when leadership is lost: the lost term's function
// returns, the lease is released only then, and Run campaigns again and
// leads a greater term. It returns when its context ends.
func TestRunCampaignsAgainAfterLoss(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := &releases{Backend: memory.New()}
		e := candidate(t, mem, "a")
		ctx, cancel := context.WithCancel(t.Context())
		var (
			mu    sync.Mutex
			terms []int64
		)
		errc := make(chan error)
		go func() {
			errc <- e.Run(ctx, func(fctx context.Context, term election.Term) error {
				mu.Lock()
				terms = append(terms, term.Token)
				mu.Unlock()
				<-fctx.Done()
				// Cleanup after the loss: the lease is not released under it.
				time.Sleep(time.Second)
				if n := mem.n.Load(); n != int64(len(terms)-1) {
					t.Errorf("released %d times before the function of term %d returned", n, term.Token)
				}
				return fctx.Err()
			})
		}()
		time.Sleep(time.Second)
		mem.Expire(e.Key()) // the lease is lost: the next renewal says so
		time.Sleep(3 * ttl)
		mu.Lock()
		require.Len(t, terms, 2, "campaigned again after the loss")
		require.Greater(t, terms[1], terms[0])
		mu.Unlock()
		cancel()
		require.ErrorIs(t, <-errc, context.Canceled)
		require.EqualValues(t, 2, mem.n.Load(), "each term released once, after its function")
		_, err := e.Leader(t.Context())
		require.ErrorIs(t, err, election.ErrNoLeader)
	})
}

// A function that returns while it still leads ends Run with its result;
// the lease is released.
func TestRunReturnsWhenFunctionReturns(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memory.New()
		e := candidate(t, mem, "a")
		boom := errors.New("boom")
		err := e.Run(t.Context(), func(ctx context.Context, term election.Term) error { return boom })
		require.ErrorIs(t, err, boom)
		_, err = e.Leader(t.Context())
		require.ErrorIs(t, err, election.ErrNoLeader)
		require.NoError(t, e.Run(t.Context(), func(context.Context, election.Term) error { return nil }))
	})
}

// A panic in the function releases the lease and panics again.
func TestRunPanicReleases(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memory.New()
		e := candidate(t, mem, "a")
		require.PanicsWithValue(t, "boom", func() {
			_ = e.Run(t.Context(), func(context.Context, election.Term) error { panic("boom") })
		})
		_, err := e.Leader(t.Context())
		require.ErrorIs(t, err, election.ErrNoLeader)
	})
}

// Observe reports each change in order, "no leader" included, and never a
// lower term.
func TestObserve(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memory.New()
		a, b := candidate(t, mem, "a"), candidate(t, mem, "b")
		ctx, cancel := context.WithCancel(t.Context())
		obs := a.Observe(ctx)
		o := <-obs
		require.False(t, o.Leading)
		require.Zero(t, o.Term.Token)

		la, err := a.Campaign(t.Context())
		require.NoError(t, err)
		o = <-obs
		require.True(t, o.Leading)
		require.Equal(t, la.Term().Token, o.Term.Token)
		require.NoError(t, la.Resign(t.Context()))
		o = <-obs
		require.False(t, o.Leading, "no leader after the resignation")
		require.Equal(t, la.Term().Token, o.Term.Token)

		lb, err := b.Campaign(t.Context())
		require.NoError(t, err)
		o = <-obs
		require.True(t, o.Leading)
		require.Equal(t, lb.Term().Token, o.Term.Token)
		require.Equal(t, lb.Term().Leader, o.Term.Leader)
		require.NoError(t, lb.Resign(t.Context()))
		cancel()
		for o := range obs {
			require.GreaterOrEqual(t, o.Term.Token, lb.Term().Token)
		}
	})
}

// Many candidates, leaders resigning at random: never two leaders at once,
// terms strictly increasing, every candidate keeps campaigning.
func TestOneLeaderAtATime(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memory.New()
		ctx, cancel := context.WithCancel(t.Context())
		var (
			mu      sync.Mutex
			leaders int
			last    int64
			terms   = map[int]int{}
		)
		var wg sync.WaitGroup
		for i := range 5 {
			e := candidate(t, mem, string(rune('a'+i)))
			wg.Go(func() {
				for ctx.Err() == nil {
					err := e.Run(ctx, func(fctx context.Context, term election.Term) error {
						mu.Lock()
						leaders++
						if leaders != 1 {
							t.Errorf("%d leaders at once", leaders)
						}
						if term.Token <= last {
							t.Errorf("term %d after %d", term.Token, last)
						}
						last = term.Token
						terms[i]++
						mu.Unlock()
						select {
						case <-fctx.Done():
						case <-time.After(time.Duration(200+100*i) * time.Millisecond):
						}
						mu.Lock()
						leaders--
						mu.Unlock()
						return nil // resign: Run returns, and the loop campaigns again
					})
					if err != nil && !errors.Is(err, context.Canceled) {
						t.Error(err)
					}
					// Campaign again a little later: the others, woken by
					// the release at this very instant, go first (else
					// who wins is up to the scheduler, and under load
					// the same candidate could win every term).
					time.Sleep(10 * time.Millisecond)
				}
			})
		}
		time.Sleep(time.Minute)
		cancel()
		wg.Wait()
		mu.Lock()
		defer mu.Unlock()
		require.GreaterOrEqual(t, len(terms), 2, "leadership moved between candidates")
		require.Greater(t, last, int64(20))
	})
}

// hangingRenewals makes every renewal hang until its context ends, in
// either form (the embedded backend's batch renewal would otherwise be
// promoted and bypass TryRenew).
type hangingRenewals struct{ *memory.Backend }

func (h hangingRenewals) TryRenew(ctx context.Context, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
	<-ctx.Done()
	return sqllock.Lease{}, errors.Join(sqllock.ErrUnavailable, ctx.Err())
}

func (h hangingRenewals) TryRenewBatch(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
	<-ctx.Done()
	return nil, errors.Join(sqllock.ErrUnavailable, ctx.Err())
}

// No one leads past the guard's local deadline: when renewals hang, the
// leader's context ends at send time + TTL - margin, before the database
// could grant the term to another candidate.
func TestLeaderStopsAtLocalDeadline(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		e := candidate(t, hangingRenewals{memory.New()}, "a")
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		start := time.Now()
		var ended time.Time
		done := make(chan error)
		go func() {
			done <- e.Run(ctx, func(fctx context.Context, term election.Term) error {
				<-fctx.Done()
				ended = time.Now()
				cancel() // stop campaigning: this test looks at one term
				return nil
			})
		}()
		require.ErrorIs(t, <-done, context.Canceled)
		margin := ttl/100 + 2*time.Millisecond // sqllock's default
		require.Equal(t, ttl-margin, ended.Sub(start), "the term ended at its local deadline")
	})
}

// lateFirstGrant applies the first acquire at once but delivers its reply
// only after the TTL: after the local deadline, too late to use.
type lateFirstGrant struct {
	*memory.Backend
	n atomic.Int64
}

func (b *lateFirstGrant) TryAcquire(ctx context.Context, req sqllock.AcquireRequest) (sqllock.Lease, error) {
	l, err := b.Backend.TryAcquire(ctx, req)
	if b.n.Add(1) == 1 {
		time.Sleep(ttl)
	}
	return l, err
}

// A grant whose reply arrives after its local deadline is not a reason to
// stop campaigning: the client releases it, and Campaign (and so Run)
// campaigns again and wins the next term. Found by the election
// simulation (TestElectionSim), where Run returned the *LostError of a
// grant whose reply a delay fault held past the local deadline.
func TestCampaignAgainAfterLateGrant(t *testing.T) {
	t.Run("Campaign", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			e := candidate(t, &lateFirstGrant{Backend: memory.New()}, "a")
			l, err := e.Campaign(t.Context())
			require.NoError(t, err)
			require.EqualValues(t, 2, l.Term().Token, "term 1 came too late and was released")
			require.NoError(t, l.Resign(t.Context()))
		})
	})
	t.Run("Run", func(t *testing.T) {
		synctest.Test(t, func(t *testing.T) {
			e := candidate(t, &lateFirstGrant{Backend: memory.New()}, "a")
			var terms []int64
			err := e.Run(t.Context(), func(ctx context.Context, term election.Term) error {
				terms = append(terms, term.Token)
				return nil
			})
			require.NoError(t, err)
			require.Equal(t, []int64{2}, terms)
		})
	})
}

// staleList serves, once stale is set, the first answer of List it gave
// (a lagging replica or cache).
type staleList struct {
	*memory.Backend
	stale atomic.Bool

	mu    sync.Mutex
	first []sqllock.LockInfo
}

func (s *staleList) List(ctx context.Context, prefix string) ([]sqllock.LockInfo, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.stale.Load() && s.first != nil {
		return s.first, nil
	}
	infos, err := s.Backend.List(ctx, prefix)
	if err == nil && s.first == nil {
		s.first = infos
	}
	return infos, err
}

// A term Observe reported ended is never reported leading again, even
// when a read comes back stale (or the database clock steps back over the
// term's deadline): a term does not come back. Found by the election
// simulation (TestElectionSim, observers with stale reads).
func TestObserveNeverRevivesAnEndedTerm(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memory.New()
		a := candidate(t, mem, "a")
		la, err := a.Campaign(t.Context())
		require.NoError(t, err)
		sl := &staleList{Backend: mem}
		b := candidate(t, sl, "b")
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		obs := b.Observe(ctx)
		o := <-obs
		require.True(t, o.Leading)
		require.NoError(t, la.Resign(t.Context()))
		o = <-obs
		require.False(t, o.Leading)
		require.Equal(t, la.Term().Token, o.Term.Token)

		sl.stale.Store(true) // every read now says term 1 leads
		time.Sleep(time.Second)
		synctest.Wait()
		select {
		case o := <-obs:
			t.Fatalf("an ended term reported again: %+v", o)
		default:
		}
	})
}

// Observe never reports a term lower than one it reported, even when a
// read comes back stale (a lagging replica): after term 2 was reported,
// a read that says term 1 leads is not reported.
func TestObserveNeverReportsALowerTerm(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		mem := memory.New()
		a := candidate(t, mem, "a")
		sl := &staleList{Backend: mem}
		obs0 := candidate(t, sl, "observer")
		la, err := a.Campaign(t.Context())
		require.NoError(t, err)
		ctx, cancel := context.WithCancel(t.Context())
		defer cancel()
		obs := obs0.Observe(ctx)
		o := <-obs
		require.True(t, o.Leading)
		require.Equal(t, la.Term().Token, o.Term.Token) // the stale read to come
		require.NoError(t, la.Resign(t.Context()))
		o = <-obs
		require.False(t, o.Leading)

		b := candidate(t, mem, "b")
		lb, err := b.Campaign(t.Context())
		require.NoError(t, err)
		defer func() { require.NoError(t, lb.Resign(context.Background())) }()
		o = <-obs
		require.True(t, o.Leading)
		require.Equal(t, lb.Term().Token, o.Term.Token)
		require.Greater(t, lb.Term().Token, la.Term().Token)

		sl.stale.Store(true) // every read now says term 1 leads
		time.Sleep(time.Second)
		synctest.Wait()
		select {
		case o := <-obs:
			t.Fatalf("term %d reported after term %d: %+v", o.Term.Token, lb.Term().Token, o)
		default:
		}
	})
}
