package sqllock_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

func Example() {
	ctx := context.Background()
	client, err := sqllock.New(memory.New(), sqllock.Options{Owner: "worker-1"})
	if err != nil {
		panic(err)
	}
	defer client.Close(ctx)

	err = client.Do(ctx, "nightly-report", nil, func(ctx context.Context, g *sqllock.Guard) error {
		// ctx is cancelled if the lease is lost: stop working then.
		fmt.Println("building the report with token", g.Token())
		return nil
	})
	fmt.Println("done:", err)
	// Output:
	// building the report with token 1
	// done: <nil>
}

func ExampleClient_TryAcquire() {
	ctx := context.Background()
	backend := memory.New()
	a, _ := sqllock.New(backend, sqllock.Options{Owner: "a"})
	b, _ := sqllock.New(backend, sqllock.Options{Owner: "b"})
	defer a.Close(ctx)
	defer b.Close(ctx)

	g, err := a.TryAcquire(ctx, "migrations", &sqllock.AcquireOptions{TTL: time.Minute})
	if err != nil {
		panic(err)
	}
	defer g.Release(ctx)

	_, err = b.TryAcquire(ctx, "migrations", nil)
	var held *sqllock.HeldError
	if errors.As(err, &held) {
		// A lease's owner is the client's name, "/", and a part unique
		// to the acquire call.
		name, _, _ := strings.Cut(held.Owner, "/")
		fmt.Println(errors.Is(err, sqllock.ErrNotAcquired), "held by", name, "token", held.Token)
	}
	// Output:
	// true held by a token 1
}

func ExampleClient_Acquire() {
	ctx := context.Background()
	client, _ := sqllock.New(memory.New(), sqllock.Options{})
	defer client.Close(ctx)

	first, _ := client.TryAcquire(ctx, "deploy", nil)
	go func() {
		time.Sleep(10 * time.Millisecond)
		first.Release(ctx) // the waiter below wakes at once
	}()

	// Wait up to a minute for the key.
	g, err := client.Acquire(ctx, "deploy", &sqllock.AcquireOptions{Wait: time.Minute})
	if err != nil {
		fmt.Println("not acquired:", err)
		return
	}
	defer g.Release(ctx)
	fmt.Println("acquired with token", g.Token(), "after token", first.Token())
	// Output:
	// acquired with token 2 after token 1
}

// Three replicas of a service fire the same nightly job at once; with nil
// options each Do makes one attempt, so the job runs once and the other
// two skip it.
func ExampleClient_Do() {
	ctx := context.Background()
	backend := memory.New() // one database shared by the replicas

	var (
		skipped = make(chan struct{}, 2) // the replicas that find the key held
		ran     atomic.Int32
		wg      sync.WaitGroup
	)
	for i := range 3 {
		client, _ := sqllock.New(backend, sqllock.Options{Owner: fmt.Sprint("replica-", i)})
		defer client.Close(ctx)
		wg.Go(func() {
			err := client.Do(ctx, "nightly-report", nil, func(ctx context.Context, g *sqllock.Guard) error {
				ran.Add(1)
				for range 2 { // the job runs on while the others fire
					select {
					case <-skipped:
					case <-time.After(time.Second):
					}
				}
				return nil
			})
			if errors.Is(err, sqllock.ErrNotAcquired) {
				skipped <- struct{}{} // another replica runs it: skip
			} else if err != nil {
				panic(err)
			}
		})
	}
	wg.Wait()
	fmt.Println("runs:", ran.Load())
	// Output:
	// runs: 1
}

// With Wait set to WaitForever, Do waits its turn: every call runs fn.
func ExampleClient_Do_wait() {
	ctx := context.Background()
	client, _ := sqllock.New(memory.New(), sqllock.Options{})
	defer client.Close(ctx)

	var (
		mu      sync.Mutex
		counter int
		wg      sync.WaitGroup
	)
	for range 4 {
		wg.Go(func() {
			err := client.Do(ctx, "counter", &sqllock.AcquireOptions{Wait: sqllock.WaitForever}, func(ctx context.Context, g *sqllock.Guard) error {
				mu.Lock() // only for the race detector: the lease already excludes
				counter++
				mu.Unlock()
				return nil
			})
			if err != nil {
				panic(err)
			}
		})
	}
	wg.Wait()
	fmt.Println("counter:", counter)
	// Output:
	// counter: 4
}

// A resource that remembers the highest fencing token it has seen refuses
// a stale holder's write, however late it arrives.
func ExampleGuard_Token() {
	ctx := context.Background()
	backend := memory.New()
	client, _ := sqllock.New(backend, sqllock.Options{})
	defer client.Close(ctx)

	store := &fencedStore{}

	old, _ := client.TryAcquire(ctx, "config", nil)
	backend.Expire("config") // old holder paused past its lease...
	newer, _ := client.TryAcquire(ctx, "config", nil)

	fmt.Println(store.Write(newer.Token(), "v2"))
	fmt.Println(store.Write(old.Token(), "v1 (stale)")) // ...wakes up and writes
	fmt.Println("value:", store.value)
	// Output:
	// <nil>
	// stale token 1 < 2
	// value: v2
}

type fencedStore struct {
	mu    sync.Mutex
	fence int64
	value string
}

func (s *fencedStore) Write(token int64, v string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if token < s.fence {
		return fmt.Errorf("stale token %d < %d", token, s.fence)
	}
	s.fence, s.value = token, v
	return nil
}
