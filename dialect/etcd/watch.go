package etcd

import (
	"context"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/internal/wait"
	"github.com/ashlock/ashlock/sqllock"
)

// watches runs one etcd watch per watched key, shared by all of the key's
// watchers, for as long as the key has one.
type watches struct {
	b       *Backend
	signals wait.Signals

	mu   sync.Mutex // guards keys
	keys map[string]*keyWatch
}

type keyWatch struct {
	n      int // watchers
	cancel context.CancelFunc
	done   chan struct{}
}

// Watch implements [sqllock.Watcher] with an etcd watch on the key's
// holder, and on its permits' holders when key is a semaphore's: a
// deletion, by a release or by etcd's expiry of the lease, signals the
// key's watchers. The watch also signals once it is
// established (and again after etcd re-established it), since a release
// may have come before. The function returned stops the watch and waits
// for its goroutine; call it once.
func (b *Backend) Watch(key string) (<-chan struct{}, func()) {
	ch, stop := b.watch.signals.Watch(key)
	b.watch.start(key)
	var once sync.Once
	return ch, func() {
		once.Do(func() {
			stop()
			b.watch.stop(key)
		})
	}
}

func (w *watches) start(key string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.keys == nil {
		w.keys = make(map[string]*keyWatch)
	}
	kw := w.keys[key]
	if kw == nil {
		ctx, cancel := context.WithCancel(context.Background())
		kw = &keyWatch{cancel: cancel, done: make(chan struct{})}
		w.keys[key] = kw
		go w.run(ctx, key, kw.done)
	}
	kw.n++
}

func (w *watches) stop(key string) {
	w.mu.Lock()
	kw := w.keys[key]
	kw.n--
	if kw.n > 0 {
		w.mu.Unlock()
		return
	}
	delete(w.keys, key)
	w.mu.Unlock()
	kw.cancel()
	<-kw.done
}

// run watches key's holder, and the holders of the permits of a
// semaphore key (its permits' releases wake its waiters), until ctx ends:
// one etcd watch on the range from key's holder to its permits' last,
// whose events for other keys in the range are dropped here.
// WithRequireLeader makes a member that lost its leader cancel the watch
// instead of going silent; the watch is then set up again, from now on,
// and signals once more.
func (w *watches) run(ctx context.Context, key string, done chan struct{}) {
	defer close(done)
	hkey := w.b.holderKey(key)
	// From K's holder through its permits' and its reader slots'
	// ('.' follows '-'): a release of any of them wakes K's waiters.
	end := w.b.holderKey(key + "#shared.")
	for ctx.Err() == nil {
		wch := w.b.cli.Watch(clientv3.WithRequireLeader(ctx), hkey, clientv3.WithRange(end),
			clientv3.WithFilterPut(), clientv3.WithCreatedNotify())
		for wr := range wch {
			// Created: the watch is on (a release may have come before it);
			// events: a holder was deleted; canceled (the channel closes
			// next): whatever comes before the next watch is missed.
			if len(wr.Events) == 0 || w.ours(key, wr.Events) {
				w.signals.Signal(key)
			}
		}
		if wait.Sleep(ctx, 100*time.Millisecond) != nil {
			return
		}
	}
}

// ours reports whether one of evs is the deletion of key's holder, of
// the holder of a permit of semaphore key, or of a reader slot of key's.
func (w *watches) ours(key string, evs []*clientv3.Event) bool {
	for _, ev := range evs {
		k := strings.TrimPrefix(string(ev.Kv.Key), w.b.holderKey(""))
		if k == key {
			return true
		}
		if sem, _, ok := sqllock.ParsePermitKey(k); ok && sem == key {
			return true
		}
		if k2, _, ok := sqllock.ParseSharedKey(k); ok && k2 == key {
			return true // a reader of key left
		}
	}
	return false
}
