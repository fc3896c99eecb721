package backendtest

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// The rules of the all-or-nothing acquire of a set of keys
// ([sqllock.MultiAcquirer]). A backend that does not implement it skips
// them.

func multiTests() []struct {
	name string
	fn   func(t *testing.T, h Harness)
} {
	return []struct {
		name string
		fn   func(t *testing.T, h Harness)
	}{
		{"MultiGrantsEveryKeyAsSingleAcquires", testMultiGrantsEveryKey},
		{"MultiOneHeldRefusesAllWithoutTrace", testMultiOneHeldRefusesAll},
		{"MultiRefusalNamesFirstHeldInKeyOrder", testMultiFirstHeldInKeyOrder},
		{"MultiSameOwnerRepeatGetsSameTokens", testMultiSameOwnerRepeat},
		{"MultiTokensStrictlyIncrease", testMultiTokensIncrease},
		{"MultiTokenExhaustionRefusesAll", testMultiTokenExhaustion},
		{"MultiMinHoldKeyRefusesAll", testMultiMinHoldRefuses},
		{"MultiBadInputRefusedWithoutTrace", testMultiBadInput},
		{"MultiOverlappingSetsUnderConcurrency", testMultiOverlapStress},
		{"ReleaseAllAnswersAsSingleReleases", testReleaseAllAsSingles},
		{"ReleaseAllKeepsMinHold", testReleaseAllMinHold},
		{"ReleaseAllBadInputBeforeIO", testReleaseAllBadInput},
		{"ReleaseAllNotSentReleasesNothing", testReleaseAllNotSent},
	}
}

func multi(t *testing.T, b sqllock.Backend) sqllock.MultiAcquirer {
	t.Helper()
	ma, ok := b.(sqllock.MultiAcquirer)
	if !ok {
		t.Skip("backend does not implement sqllock.MultiAcquirer")
	}
	return ma
}

func acquireAll(t *testing.T, ma sqllock.MultiAcquirer, owner string, keys ...string) []sqllock.Lease {
	t.Helper()
	ls, err := ma.TryAcquireAll(ctx(t), sqllock.MultiAcquireRequest{Keys: keys, TTL: ttl, Owner: owner})
	if err != nil {
		t.Fatalf("TryAcquireAll(%q, %q): %v", keys, owner, err)
	}
	if len(ls) != len(keys) {
		t.Fatalf("TryAcquireAll(%q, %q) returned %d leases, want %d", keys, owner, len(ls), len(keys))
	}
	for i, l := range ls {
		if l.Key != keys[i] || l.Owner != owner || l.Token <= 0 {
			t.Fatalf("TryAcquireAll(%q, %q)[%d] = %+v: wrong key, owner or token", keys, owner, i, l)
		}
	}
	return ls
}

func refusedAll(t *testing.T, ma sqllock.MultiAcquirer, owner string, keys ...string) *sqllock.HeldError {
	t.Helper()
	ls, err := ma.TryAcquireAll(ctx(t), sqllock.MultiAcquireRequest{Keys: keys, TTL: ttl, Owner: owner})
	var he *sqllock.HeldError
	if !errors.Is(err, sqllock.ErrNotAcquired) || !errors.As(err, &he) {
		t.Fatalf("TryAcquireAll(%q, %q) = %+v, %v; want a *HeldError matching ErrNotAcquired", keys, owner, ls, err)
	}
	if ls != nil {
		t.Errorf("a refused TryAcquireAll returned leases %+v", ls)
	}
	return he
}

// snapshot is List without the remaining times, which change as time
// passes: what a refusal must leave as it was.
func snapshot(t *testing.T, b sqllock.Backend) string {
	t.Helper()
	all, err := b.List(ctx(t), "")
	if err != nil {
		t.Fatalf("List: %v", err)
	}
	var s strings.Builder
	for _, i := range all {
		fmt.Fprintf(&s, "%q token=%d owner=%q held=%v deadline=%v value=%q\n", i.Key, i.Token, i.Owner, i.Held, i.Deadline.UTC(), i.Value)
	}
	return s.String()
}

// Every key of the set is granted, whatever its past (fresh: its first
// row written by the same step; released; expired), with the token a
// single acquire of it would have got, and each lease is an ordinary one.
func testMultiGrantsEveryKey(t *testing.T, h Harness) {
	b := h.New(t)
	ma := multi(t, b)
	// Each key of the set has a twin with the same past, taken alone.
	for _, k := range []string{"released", "released-twin"} {
		release(t, b, acquire(t, b, k, "o0"))
	}
	for _, k := range []string{"expired", "expired-twin"} {
		acquire(t, b, k, "o0")
		h.Expire(t, b, k)
	}
	keys := []string{"released", "fresh", "expired"}
	ls, err := ma.TryAcquireAll(ctx(t), sqllock.MultiAcquireRequest{Keys: keys, TTL: ttl, Owner: "o1", Value: []byte("v")})
	if err != nil {
		t.Fatalf("TryAcquireAll: %v", err)
	}
	if len(ls) != len(keys) {
		t.Fatalf("TryAcquireAll returned %d leases, want %d", len(ls), len(keys))
	}
	for i, k := range keys {
		l := ls[i]
		twin := acquire(t, b, k+"-twin", "o1")
		if l.Key != k || l.Owner != "o1" || l.Token != twin.Token {
			t.Errorf("lease %d = key %q owner %q token %d, want key %q owner o1 and the token a single acquire got, %d",
				i, l.Key, l.Owner, l.Token, k, twin.Token)
		}
		if got := l.Deadline.Sub(l.BackendTime); got < ttl || got > ttl+time.Millisecond {
			t.Errorf("%s: Deadline - BackendTime = %v, want TTL %v", k, got, ttl)
		}
		if string(l.Value) != "v" {
			t.Errorf("%s: value %q, want %q", k, l.Value, "v")
		}
		if i, ok := info(t, b, k); !ok || !i.Held || i.Token != l.Token || i.Owner != "o1" || string(i.Value) != "v" {
			t.Errorf("List after TryAcquireAll = %+v (found %v), want %s held by o1 with token %d", i, ok, k, l.Token)
		}
		he := held(t, b, k, "o2")
		if he.Owner != "o1" || he.Token != l.Token {
			t.Errorf("%s: a single acquire was refused by %+v, want the set's owner o1 and token %d", k, he, l.Token)
		}
	}
	for _, l := range ls {
		r, err := b.TryRenew(ctx(t), l, 2*ttl)
		if err != nil || r.Token != l.Token {
			t.Fatalf("TryRenew of the set's lease %q: %+v, %v", l.Key, r, err)
		}
		release(t, b, l)
	}
}

// One key held by another owner refuses the whole set: the refusal names
// that key, its holder, token and remaining time, and no key of the set
// changed (a fresh key got no row).
func testMultiOneHeldRefusesAll(t *testing.T, h Harness) {
	b := h.New(t)
	ma := multi(t, b)
	release(t, b, acquire(t, b, "a", "o0"))
	hl := acquire(t, b, "b", "o1")
	acquire(t, b, "d", "o2")
	h.Expire(t, b, "d")
	before := snapshot(t, b)
	he := refusedAll(t, ma, "o2", "c", "b", "a", "d")
	if he.Key != "b" || he.Owner != "o1" || he.Token != hl.Token || he.Remaining <= 0 || he.Remaining > ttl {
		t.Errorf("HeldError = %+v, want key b, owner o1, token %d, remaining in (0, %v]", he, hl.Token, ttl)
	}
	if after := snapshot(t, b); after != before {
		t.Errorf("a refused TryAcquireAll changed the table:\nbefore:\n%safter:\n%s", before, after)
	}
	if _, ok := info(t, b, "c"); ok {
		t.Errorf("a refused TryAcquireAll left a row for its fresh key c")
	}
	// Nothing of the refused set holds its keys: another owner takes
	// them, each above its last token.
	for _, k := range []string{"a", "c", "d"} {
		acquire(t, b, k, "o3")
	}
}

// The refusal names the first key that cannot be granted in ascending key
// order, whatever the order of the request.
func testMultiFirstHeldInKeyOrder(t *testing.T, h Harness) {
	b := h.New(t)
	ma := multi(t, b)
	m := acquire(t, b, "m", "o1")
	acquire(t, b, "z", "o3")
	for _, keys := range [][]string{{"z", "a", "m"}, {"a", "m", "z"}, {"m", "z", "a"}} {
		he := refusedAll(t, ma, "o2", keys...)
		if he.Key != "m" || he.Owner != "o1" || he.Token != m.Token {
			t.Errorf("TryAcquireAll(%q) refused by %+v, want the first held key in key order: m, held by o1", keys, he)
		}
	}
}

// Repeating a request (same owner) after a lost reply returns the same
// tokens and extends the deadlines, never a second tenure.
func testMultiSameOwnerRepeat(t *testing.T, h Harness) {
	b := h.New(t)
	ma := multi(t, b)
	release(t, b, acquire(t, b, "y", "o0"))
	first := acquireAll(t, ma, "o1", "x", "y", "z")
	again := acquireAll(t, ma, "o1", "z", "x", "y")
	for i, l := range again {
		f := first[(i+2)%3]
		if l.Token != f.Token {
			t.Errorf("%s: the repeat got token %d, want the same grant %d", l.Key, l.Token, f.Token)
		}
		if l.Deadline.Before(f.Deadline) {
			t.Errorf("%s: the repeat moved the deadline back: %v < %v", l.Key, l.Deadline, f.Deadline)
		}
		if got := l.Deadline.Sub(l.BackendTime); got < ttl {
			t.Errorf("%s: the repeat's deadline is %v after its backend time, want >= TTL %v", l.Key, got, ttl)
		}
	}
	refusedAll(t, ma, "o2", "x")
	held(t, b, "y", "o2")
}

// Across releases, expiries and single acquires between them, each key's
// token strictly increases.
func testMultiTokensIncrease(t *testing.T, h Harness) {
	b := h.New(t)
	ma := multi(t, b)
	last := map[string]int64{}
	keys := []string{"p", "q", "r"}
	for round := range 6 {
		owner := fmt.Sprintf("o%d", round)
		var ls []sqllock.Lease
		if round%3 == 2 {
			for _, k := range keys {
				ls = append(ls, acquire(t, b, k, owner))
			}
		} else {
			ls = acquireAll(t, ma, owner, keys...)
		}
		for _, l := range ls {
			if l.Token <= last[l.Key] {
				t.Fatalf("round %d: %s got token %d, want > %d", round, l.Key, l.Token, last[l.Key])
			}
			last[l.Key] = l.Token
			if round%2 == 0 {
				release(t, b, l)
			} else {
				h.Expire(t, b, l.Key)
			}
		}
	}
}

// A key at the end of its token space refuses the whole set, naming it.
func testMultiTokenExhaustion(t *testing.T, h Harness) {
	if h.SetToken == nil {
		t.Skip("Harness.SetToken not given")
	}
	b := h.New(t)
	ma := multi(t, b)
	h.SetToken(t, b, "max", math.MaxInt64)
	before := snapshot(t, b)
	_, err := ma.TryAcquireAll(ctx(t), sqllock.MultiAcquireRequest{Keys: []string{"zfresh", "max"}, TTL: ttl, Owner: "o1"})
	if !errors.Is(err, sqllock.ErrTokenExhausted) || !strings.Contains(err.Error(), `"max"`) {
		t.Fatalf("TryAcquireAll with an exhausted key: %v, want ErrTokenExhausted naming \"max\"", err)
	}
	if after := snapshot(t, b); after != before {
		t.Errorf("a refused TryAcquireAll changed the table:\nbefore:\n%safter:\n%s", before, after)
	}
}

// A key released by its holder inside its min hold is still taken, for a
// set as for a single acquire.
func testMultiMinHoldRefuses(t *testing.T, h Harness) {
	if h.NoMinHold {
		t.Skip("the backend keeps no min hold")
	}
	b := h.New(t)
	ma := multi(t, b)
	l, err := b.TryAcquire(ctx(t), sqllock.AcquireRequest{Key: "job", TTL: ttl, Owner: "o1", MinHold: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	release(t, b, l)
	before := snapshot(t, b)
	he := refusedAll(t, ma, "o2", "free", "job")
	if he.Key != "job" || he.Token != l.Token {
		t.Errorf("HeldError = %+v, want key job, token %d (released inside its min hold)", he, l.Token)
	}
	if after := snapshot(t, b); after != before {
		t.Errorf("a refused TryAcquireAll changed the table:\nbefore:\n%safter:\n%s", before, after)
	}
}

// MultiBadInputs is the table of multi-key requests every
// [sqllock.MultiAcquirer] refuses the same way, before any I/O.
func MultiBadInputs() []BadInput {
	acq := func(keys []string, ttl time.Duration, owner string, value []byte) func(context.Context, sqllock.Backend) error {
		return func(ctx context.Context, b sqllock.Backend) error {
			ls, err := b.(sqllock.MultiAcquirer).TryAcquireAll(ctx, sqllock.MultiAcquireRequest{Keys: keys, TTL: ttl, Owner: owner, Value: value})
			if err == nil || ls != nil {
				return fmt.Errorf("TryAcquireAll(%q) = %d leases, %v; want a refusal without leases", keys, len(ls), err)
			}
			return err
		}
	}
	many := make([]string, sqllock.MaxKeysPerAcquire+1)
	for i := range many {
		many[i] = fmt.Sprintf("k%03d", i)
	}
	return []BadInput{
		{"MultiNoKeys", acq(nil, ttl, "o", nil), sqllock.ErrInvalidKey},
		{"MultiEmptySet", acq([]string{}, ttl, "o", nil), sqllock.ErrInvalidKey},
		{"MultiTooManyKeys", acq(many, ttl, "o", nil), sqllock.ErrInvalidKey},
		{"MultiDuplicateKey", acq([]string{"a", "b", "a"}, ttl, "o", nil), sqllock.ErrInvalidKey},
		{"MultiDuplicateKeyAdjacent", acq([]string{"x", "x"}, ttl, "o", nil), sqllock.ErrInvalidKey},
		{"MultiEmptyKey", acq([]string{"a", ""}, ttl, "o", nil), sqllock.ErrInvalidKey},
		{"MultiKeyNUL", acq([]string{"a", "b\x00"}, ttl, "o", nil), sqllock.ErrInvalidKey},
		{"MultiKeyInvalidUTF8", acq([]string{"\xff"}, ttl, "o", nil), sqllock.ErrInvalidKey},
		{"MultiPermitKey", acq([]string{"a", sqllock.PermitKey("pool", 1)}, ttl, "o", nil), sqllock.ErrInvalidKey},
		{"MultiLimitKey", acq([]string{sqllock.LimitKey("pool"), "z"}, ttl, "o", nil), sqllock.ErrInvalidKey},
		{"MultiSharedSlotKey", acq([]string{"a", sqllock.SharedKey("cfg", 1)}, ttl, "o", nil), sqllock.ErrInvalidKey},
		{"MultiKeyTooLong", acq([]string{strings.Repeat("k", sqllock.MaxKeyLen+1)}, ttl, "o", nil), sqllock.ErrInvalidKey},
		{"MultiTTLZero", acq([]string{"a"}, 0, "o", nil), sqllock.ErrInvalidTTL},
		{"MultiTTLAboveMax", acq([]string{"a"}, sqllock.MaxTTL+1, "o", nil), sqllock.ErrInvalidTTL},
		{"MultiEmptyOwner", acq([]string{"a"}, ttl, "", nil), sqllock.ErrInvalidOwner},
		{"MultiOwnerNUL", acq([]string{"a"}, ttl, "o\x00", nil), sqllock.ErrInvalidOwner},
		{"MultiValueTooLong", acq([]string{"a"}, ttl, "o", make([]byte, sqllock.MaxValueLen+1)), sqllock.ErrInvalidValue},
	}
}

func testMultiBadInput(t *testing.T, h Harness) {
	b := h.New(t)
	multi(t, b)
	l := acquire(t, b, "k", "o1")
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, in := range MultiBadInputs() {
		for _, c := range []context.Context{ctx(t), cancelled} {
			if err := in.Op(c, b); !errors.Is(err, in.Want) {
				t.Errorf("%s: got %v, want %v", in.Name, err, in.Want)
			}
		}
	}
	all, err := b.List(ctx(t), "")
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 1 || all[0].Key != "k" || !all[0].Held || all[0].Token != l.Token {
		t.Errorf("bad input left a trace: List = %+v, want only k held with token %d", all, l.Token)
	}
}

// Goroutines take overlapping sets (in opposite orders too) over and over
// and release them: every call ends (no deadlock between overlapping
// sets), a grant carries every key of its set, no key is ever granted
// while another set holds it, every key's token strictly increases, and
// once all is released no key is left held (a partial grant would be).
func testMultiOverlapStress(t *testing.T, h Harness) {
	b := h.New(t)
	ma := multi(t, b)
	pool := []string{"s0", "s1", "s2", "s3", "s4", "s5"}
	const workers, rounds = 8, 40
	var (
		mu      sync.Mutex
		holder  = map[string]string{} // key -> owner, between grant and release
		last    = map[string]int64{}
		grants  int
		refused int
	)
	fail := func(format string, args ...any) {
		t.Helper()
		t.Errorf(format, args...)
	}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), 7))
			for r := range rounds {
				keys := slices.Clone(pool)
				rng.Shuffle(len(keys), func(i, j int) { keys[i], keys[j] = keys[j], keys[i] })
				keys = keys[:2+rng.IntN(3)]
				owner := fmt.Sprintf("w%d-%d", w, r)
				ls, err := ma.TryAcquireAll(ctx(t), sqllock.MultiAcquireRequest{Keys: keys, TTL: ttl, Owner: owner})
				if errors.Is(err, sqllock.ErrNotAcquired) {
					mu.Lock()
					refused++
					mu.Unlock()
					continue
				}
				if err != nil {
					fail("TryAcquireAll(%q): %v", keys, err)
					return
				}
				mu.Lock()
				grants++
				if len(ls) != len(keys) {
					fail("%s: a grant of %d leases for %d keys", owner, len(ls), len(keys))
				}
				for _, l := range ls {
					if o, ok := holder[l.Key]; ok {
						fail("%s granted %q while %s holds it", owner, l.Key, o)
					}
					if l.Token <= last[l.Key] {
						fail("%s: %q token %d, want > %d", owner, l.Key, l.Token, last[l.Key])
					}
					holder[l.Key], last[l.Key] = owner, l.Token
				}
				mu.Unlock()
				runtime.Gosched() // the critical section
				mu.Lock()
				for _, l := range ls {
					delete(holder, l.Key) // before the release: a grant after it is no overlap
				}
				mu.Unlock()
				for _, l := range ls {
					if err := b.Release(ctx(t), l); err != nil {
						fail("Release(%q, %d): %v", l.Key, l.Token, err)
					}
				}
			}
		})
	}
	wg.Wait()
	if grants == 0 {
		t.Errorf("no set was ever granted (%d refusals)", refused)
	}
	all, err := b.List(ctx(t), "")
	if err != nil {
		t.Fatal(err)
	}
	for _, i := range all {
		if i.Held {
			t.Errorf("after every grant was released, %q is still held by %q (token %d): a partial grant", i.Key, i.Owner, i.Token)
		}
	}
	t.Logf("%d grants, %d refusals", grants, refused)
}
