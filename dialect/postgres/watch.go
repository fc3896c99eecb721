package postgres

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/ashlock/ashlock/internal/wait"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Watch implements [sqllock.Watcher]: the channel receives a value after a
// Release of key by any client of the same table, through LISTEN/NOTIFY on
// one connection per Backend that the first Watch takes from the pool (and
// removes from it) and Close closes.
//
// Whenever that connection starts listening, the first time and after every
// reconnect (it reconnects with backoff when it fails), every watcher gets a
// wake-up, because releases may have been missed while it was not
// listening; so a release after Watch returns is never missed, at worst
// reported by a spurious wake-up. With [Options.DisableNotify], or after
// Close, the channel never fires and the client finds releases by polling.
//
// The returned function ends the watch; call it once when done.
func (b *Backend) Watch(key string) (<-chan struct{}, func()) {
	if !b.listen {
		return make(chan struct{}, 1), func() {}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return make(chan struct{}, 1), func() {}
	}
	l := b.listener
	if l == nil {
		l = newListener(b)
		b.listener = l
	}
	// Subscribe before the listener can start listening, so the first
	// watcher is woken by the first LISTEN like every later one is by a
	// release.
	sub, unsubscribe := l.signals.Watch(key)
	b.watches.Add(1)
	l.start()
	var once sync.Once
	return sub, func() {
		once.Do(func() {
			unsubscribe()
			b.watches.Add(-1)
		})
	}
}

// watched reports whether key has a watcher on this Backend, so that
// TryAcquire sends the waiting form of its statement (see queries/acquire.sql).
// Without any watch it costs one atomic load.
func (b *Backend) watched(key string) bool {
	if b.watches.Load() == 0 {
		return false
	}
	b.mu.Lock()
	l := b.listener
	b.mu.Unlock()
	return l != nil && l.signals.Watched(key)
}

// listener owns the LISTEN connection and dispatches notifications (whose
// payload is the released key) to the watchers of that key.
type listener struct {
	b      *Backend
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}

	started bool // guarded by b.mu

	signals wait.Signals // the watchers, by key

	mu  sync.Mutex
	pid uint32 // backend PID of the listening connection, 0 when none (tests)
}

func newListener(b *Backend) *listener {
	ctx, cancel := context.WithCancel(context.Background())
	return &listener{b: b, ctx: ctx, cancel: cancel, done: make(chan struct{})}
}

// start runs the listening goroutine once; the caller holds b.mu.
func (l *listener) start() {
	if !l.started {
		l.started = true
		go l.run()
	}
}

func (l *listener) stop() {
	l.cancel()
	<-l.done
}

const (
	listenBackoffMin = 50 * time.Millisecond
	listenBackoffMax = 5 * time.Second
)

func (l *listener) run() {
	defer close(l.done)
	failures := 0
	for {
		listened, err := l.session()
		if l.ctx.Err() != nil {
			return
		}
		if listened {
			failures = 0
		}
		delay := min(listenBackoffMin<<min(failures, 10), listenBackoffMax)
		delay = delay/2 + rand.N(delay/2+1) // jitter: [delay/2, delay]
		failures++
		l.b.log.Warn("sqllock/postgres: notification listener failed; reconnecting",
			"table", l.b.table, "err", err, "retry_in", delay)
		if wait.Sleep(l.ctx, delay) != nil {
			return
		}
	}
}

// session takes a connection out of the pool, listens on it and dispatches
// notifications until it fails or the listener stops. listened reports
// whether LISTEN succeeded.
func (l *listener) session() (listened bool, err error) {
	if l.b.db != nil {
		err = l.b.listenConnDB(l.ctx, func(conn *pgx.Conn) error {
			listened, err = l.listenOn(conn)
			return err
		})
		return listened, err
	}
	pc, err := l.b.pool.Acquire(l.ctx)
	if err != nil {
		return false, err
	}
	// A listening session must never go back to the pool.
	conn := pc.Hijack()
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		_ = conn.Close(ctx)
	}()
	return l.listenOn(conn)
}

// listenOn listens on conn, a connection of the listener's own, and
// dispatches notifications until it fails or the listener stops.
func (l *listener) listenOn(conn *pgx.Conn) (listened bool, err error) {
	defer func() {
		l.mu.Lock()
		l.pid = 0
		l.mu.Unlock()
	}()
	var channel string
	if err := conn.QueryRow(l.ctx, l.b.full.channel).Scan(&channel); err != nil {
		return false, err
	}
	if _, err := conn.Exec(l.ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
		return false, err
	}
	l.b.log.Debug("sqllock/postgres: listening", "table", l.b.table, "channel", channel, "pid", conn.PgConn().PID())
	// Listening from here on: a watcher added before gets a wake-up (it
	// may have missed a release), one added after needs none (a spurious
	// one, between LISTEN and this, costs it one attempt).
	l.signals.SignalAll()
	// Published after the wake-ups, so that a test which sees the PID knows
	// they have all gone out (and may drain them).
	l.mu.Lock()
	l.pid = conn.PgConn().PID()
	l.mu.Unlock()
	for {
		n, err := l.next(conn)
		if err != nil {
			return true, err
		}
		if n.Channel == channel {
			l.signal(n.Payload)
		}
	}
}

// Listening connections are checked when idle: a connection that went
// half-open (a NAT or firewall that dropped its state, a failover without
// a reset) never delivers a notification again, nor an error, and the
// kernel's keepalive notices it only after hours. A connection that has
// delivered nothing for listenIdle is pinged; one that does not answer
// within listenPing is replaced, and the watchers, which may have missed
// a release meanwhile, are woken.
const (
	listenIdle = 10 * time.Second
	listenPing = 5 * time.Second
)

// next waits for the next notification on conn, pinging it whenever it
// has been idle for the listener's idle bound.
func (l *listener) next(conn *pgx.Conn) (*pgconn.Notification, error) {
	for {
		ctx, cancel := context.WithTimeout(l.ctx, l.b.listenIdle)
		n, err := conn.WaitForNotification(ctx)
		idle := err != nil && l.ctx.Err() == nil && errors.Is(ctx.Err(), context.DeadlineExceeded)
		cancel()
		if !idle {
			return n, err
		}
		// A read that timed out leaves the connection usable.
		ctx, cancel = context.WithTimeout(l.ctx, l.b.listenPing)
		err = conn.Ping(ctx)
		cancel()
		if err != nil {
			return nil, fmt.Errorf("the listening connection did not answer a ping within %v: %w", l.b.listenPing, err)
		}
	}
}
