// Package wait holds what the backends share for waiting: the fan-out of
// release signals to the goroutines that wait for a key, and a sleep that
// ends with its context. It depends on the standard library only. (Package
// sqllock, which may depend on nothing else, keeps its own sleep.)
package wait

import (
	"context"
	"sync"
	"time"
)

// Signals fans release signals out to the watchers of each key. The zero
// value is ready to use; it is safe for concurrent use.
type Signals struct {
	mu   sync.Mutex
	subs map[string]map[chan struct{}]struct{}
}

// Watch returns a channel that receives a value after a Signal of key (at
// most one pending: signals coalesce) and a function that stops watching.
// Calling stop more than once is harmless.
func (s *Signals) Watch(key string) (<-chan struct{}, func()) {
	ch := make(chan struct{}, 1)
	s.mu.Lock()
	if s.subs == nil {
		s.subs = make(map[string]map[chan struct{}]struct{})
	}
	set := s.subs[key]
	if set == nil {
		set = make(map[chan struct{}]struct{})
		s.subs[key] = set
	}
	set[ch] = struct{}{}
	s.mu.Unlock()
	return ch, func() {
		s.mu.Lock()
		defer s.mu.Unlock()
		// Look the set up again: it may have been emptied and replaced.
		if set := s.subs[key]; set != nil {
			delete(set, ch)
			if len(set) == 0 {
				delete(s.subs, key)
			}
		}
	}
}

// Signal wakes every watcher of key without blocking.
func (s *Signals) Signal(key string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for ch := range s.subs[key] {
		notify(ch)
	}
}

// SignalAll wakes every watcher of every key (after a gap in which
// releases may have been missed).
func (s *Signals) SignalAll() {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, set := range s.subs {
		for ch := range set {
			notify(ch)
		}
	}
}

// Watched reports whether key has a watcher now.
func (s *Signals) Watched(key string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.subs[key]) > 0
}

// Len is the number of keys watched now.
func (s *Signals) Len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.subs)
}

func notify(ch chan struct{}) {
	select {
	case ch <- struct{}{}:
	default: // a signal is already pending
	}
}

// Sleep waits for d, or until ctx ends, whichever is first, and returns
// ctx's error if it ended first.
func Sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}
