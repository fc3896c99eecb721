package wait

import (
	"context"
	"testing"
	"testing/synctest"
	"time"
)

func pending(ch <-chan struct{}) bool {
	select {
	case <-ch:
		return true
	default:
		return false
	}
}

func TestSignals(t *testing.T) {
	var s Signals
	a1, stopA1 := s.Watch("a")
	a2, stopA2 := s.Watch("a")
	b, stopB := s.Watch("b")
	if s.Len() != 2 || !s.Watched("a") || s.Watched("c") {
		t.Fatalf("Len %d, Watched(a) %v, Watched(c) %v", s.Len(), s.Watched("a"), s.Watched("c"))
	}
	s.Signal("a")
	s.Signal("a") // coalesces, never blocks
	if !pending(a1) || !pending(a2) || pending(b) {
		t.Fatal("Signal(a) must wake a's watchers only")
	}
	if pending(a1) {
		t.Fatal("two signals left two values")
	}
	stopA1()
	stopA1()
	s.Signal("a")
	if pending(a1) || !pending(a2) {
		t.Fatal("a stopped watcher was woken, or a live one was not")
	}
	stopA2()
	if s.Watched("a") || s.Len() != 1 {
		t.Fatal("a key without watchers is forgotten")
	}
	s.SignalAll()
	if !pending(b) {
		t.Fatal("SignalAll must wake every watcher")
	}
	stopB()
	if s.Len() != 0 {
		t.Fatalf("Len %d after every stop", s.Len())
	}
	var zero Signals
	zero.Signal("x") // the zero value works
}

func TestSleep(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		start := time.Now()
		if err := Sleep(t.Context(), time.Second); err != nil || time.Since(start) != time.Second {
			t.Fatalf("Sleep: %v after %v", err, time.Since(start))
		}
		ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
		defer cancel()
		start = time.Now()
		if err := Sleep(ctx, time.Hour); err != context.DeadlineExceeded || time.Since(start) != 100*time.Millisecond {
			t.Fatalf("Sleep with a context: %v after %v", err, time.Since(start))
		}
	})
}
