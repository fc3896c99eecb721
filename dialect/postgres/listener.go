package postgres

import (
	"context"
	"math/rand/v2"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
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
	ch := make(chan struct{}, 1)
	if !b.notify {
		return ch, func() {}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return ch, func() {}
	}
	l := b.listener
	if l == nil {
		l = newListener(b)
		b.listener = l
	}
	// Subscribe before the listener can start listening, so the first
	// watcher is woken by the first LISTEN like every later one is by a
	// release.
	l.add(key, ch)
	b.watches.Add(1)
	l.start()
	var once sync.Once
	return ch, func() {
		once.Do(func() {
			l.remove(key, ch)
			b.watches.Add(-1)
		})
	}
}

// watched reports whether key has a watcher on this Backend, so that
// TryAcquire sends the waiting form of its statement (see acquireSQL).
// Without any watch it costs one atomic load.
func (b *Backend) watched(key string) bool {
	if b.watches.Load() == 0 {
		return false
	}
	b.mu.Lock()
	l := b.listener
	b.mu.Unlock()
	if l == nil {
		return false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.subs[key]) > 0
}

// listener owns the LISTEN connection and dispatches notifications (whose
// payload is the released key) to the watchers of that key.
type listener struct {
	b      *Backend
	ctx    context.Context
	cancel context.CancelFunc
	done   chan struct{}

	started bool // guarded by b.mu

	mu   sync.Mutex
	subs map[string]map[chan struct{}]struct{}
	pid  uint32 // backend PID of the listening connection, 0 when none (tests)
}

func newListener(b *Backend) *listener {
	ctx, cancel := context.WithCancel(context.Background())
	return &listener{b: b, ctx: ctx, cancel: cancel, done: make(chan struct{}), subs: map[string]map[chan struct{}]struct{}{}}
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

func (l *listener) add(key string, ch chan struct{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	set := l.subs[key]
	if set == nil {
		set = map[chan struct{}]struct{}{}
		l.subs[key] = set
	}
	set[ch] = struct{}{}
}

func (l *listener) remove(key string, ch chan struct{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.subs[key], ch)
	if len(l.subs[key]) == 0 {
		delete(l.subs, key)
	}
}

func signal(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default: // a wake-up is pending already
	}
}

func (l *listener) wake(key string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for ch := range l.subs[key] {
		signal(ch)
	}
}

func (l *listener) wakeAllLocked() {
	for _, set := range l.subs {
		for ch := range set {
			signal(ch)
		}
	}
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
		t := time.NewTimer(delay)
		select {
		case <-l.ctx.Done():
			t.Stop()
			return
		case <-t.C:
		}
	}
}

// session takes a connection out of the pool, listens on it and dispatches
// notifications until it fails or the listener stops. listened reports
// whether LISTEN succeeded.
func (l *listener) session() (listened bool, err error) {
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
		l.mu.Lock()
		l.pid = 0
		l.mu.Unlock()
	}()
	var channel string
	if err := conn.QueryRow(l.ctx, l.b.channelSQL).Scan(&channel); err != nil {
		return false, err
	}
	if _, err := conn.Exec(l.ctx, "LISTEN "+pgx.Identifier{channel}.Sanitize()); err != nil {
		return false, err
	}
	l.b.log.Debug("sqllock/postgres: listening", "table", l.b.table, "channel", channel, "pid", conn.PgConn().PID())
	// One step: a watcher added from here on needs no wake-up (it is
	// listened for), and one added before gets it.
	l.mu.Lock()
	l.pid = conn.PgConn().PID()
	l.wakeAllLocked()
	l.mu.Unlock()
	for {
		n, err := conn.WaitForNotification(l.ctx)
		if err != nil {
			return true, err
		}
		if n.Channel == channel {
			l.wake(n.Payload)
		}
	}
}
