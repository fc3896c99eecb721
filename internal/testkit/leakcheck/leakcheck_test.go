package leakcheck

import (
	"testing"
	"time"
)

func TestMain(m *testing.M) { VerifyTestMain(m) }

func TestFindWaitsForGoroutinesThatEnd(t *testing.T) {
	done := make(chan struct{})
	go func() {
		time.Sleep(time.Second) // longer than goleak's own retries
		close(done)
	}()
	if err := FindWithin(Patience); err != nil {
		t.Fatalf("a goroutine that ends after 1 s was reported: %v", err)
	}
	<-done
}

func TestFindReportsGoroutinesThatStay(t *testing.T) {
	stop := make(chan struct{})
	defer close(stop)
	go func() { <-stop }()
	if err := FindWithin(200 * time.Millisecond); err == nil {
		t.Fatal("a goroutine blocked for good was not reported")
	}
}
