package backendtest

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/ashlock/ashlock/sqllock"
)

// The rules of the release of a set of leases in one call
// ([sqllock.MultiReleaser]). A backend that does not implement it skips
// them.

func multiReleaser(t *testing.T, b sqllock.Backend) sqllock.MultiReleaser {
	t.Helper()
	mr, ok := b.(sqllock.MultiReleaser)
	if !ok {
		t.Skip("backend does not implement sqllock.MultiReleaser")
	}
	return mr
}

// answer describes a release's answer for comparison: "nil", the
// LostError's reason, or the error itself.
func answer(err error) string {
	var le *sqllock.LostError
	switch {
	case err == nil:
		return "nil"
	case errors.As(err, &le) && errors.Is(err, sqllock.ErrLeaseLost):
		return "lost " + le.Reason.String()
	default:
		return "error " + err.Error()
	}
}

// releaseCases sets up, under prefix, one lease of owner "o" in each
// state a release can meet, and returns the leases with the answer
// Release gives each: held (nil), released before by its owner (nil),
// released by another owner (LostReleased), expired (LostExpired), taken
// over by a newer token (LostTaken), and a fresh one held again.
func releaseCases(t *testing.T, h Harness, b sqllock.Backend, prefix string) ([]sqllock.Lease, []string) {
	t.Helper()
	var ls []sqllock.Lease
	var want []string
	add := func(l sqllock.Lease, w string) {
		ls = append(ls, l)
		want = append(want, w)
	}
	add(acquire(t, b, prefix+"held", "o"), "nil")
	again := acquire(t, b, prefix+"again", "o")
	release(t, b, again)
	add(again, "nil")
	forced := acquire(t, b, prefix+"forced", "o")
	other := forced
	other.Owner = "forcer"
	release(t, b, other)
	add(forced, "lost "+sqllock.LostReleased.String())
	expired := acquire(t, b, prefix+"expired", "o")
	h.Expire(t, b, expired.Key)
	add(expired, "lost "+sqllock.LostExpired.String())
	taken := acquire(t, b, prefix+"taken", "o")
	h.Expire(t, b, taken.Key)
	acquire(t, b, taken.Key, "newer")
	add(taken, "lost "+sqllock.LostTaken.String())
	add(acquire(t, b, prefix+"last", "o"), "nil")
	return ls, want
}

// keyStates is what List says of the keys under prefix, the prefix cut
// off, without the times (which differ between the two groups).
func keyStates(t *testing.T, b sqllock.Backend, prefix string) map[string]string {
	t.Helper()
	all, err := b.List(ctx(t), prefix)
	if err != nil {
		t.Fatalf("List(%q): %v", prefix, err)
	}
	out := make(map[string]string, len(all))
	for _, i := range all {
		out[strings.TrimPrefix(i.Key, prefix)] = fmt.Sprintf("token=%d owner=%q held=%v", i.Token, i.Owner, i.Held)
	}
	return out
}

// ReleaseAll of leases in every state (held, released before by their
// owner, released by another, expired, taken over by a newer token),
// given out of key order, answers for each exactly what Release of it
// alone answers, at its own index, and leaves every key as the single
// releases leave their twins: the newer holder untouched, the expired
// lease's row cleared.
func testReleaseAllAsSingles(t *testing.T, h Harness) {
	b := h.New(t)
	mr := multiReleaser(t, b)
	singles, want := releaseCases(t, h, b, "one/")
	together, _ := releaseCases(t, h, b, "all/")
	for i, l := range singles {
		if got := answer(b.Release(ctx(t), l)); got != want[i] {
			t.Errorf("Release(%q) = %s, want %s", l.Key, got, want[i])
		}
	}
	order := []int{3, 0, 5, 2, 4, 1} // not key order, not the cases' order
	ls := make([]sqllock.Lease, len(order))
	for k, i := range order {
		ls[k] = together[i]
	}
	answers, err := mr.ReleaseAll(ctx(t), ls)
	if err != nil {
		t.Fatalf("ReleaseAll: %v", err)
	}
	if len(answers) != len(ls) {
		t.Fatalf("ReleaseAll returned %d answers for %d leases", len(answers), len(ls))
	}
	for k, i := range order {
		if got := answer(answers[k]); got != want[i] {
			t.Errorf("ReleaseAll answer %d (%q) = %s, want %s, as Release answers", k, ls[k].Key, got, want[i])
		}
		var le *sqllock.LostError
		if errors.As(answers[k], &le) && (le.Key != ls[k].Key || le.Token != ls[k].Token) {
			t.Errorf("ReleaseAll answer %d names %q token %d, want %q token %d", k, le.Key, le.Token, ls[k].Key, ls[k].Token)
		}
	}
	one, all := keyStates(t, b, "one/"), keyStates(t, b, "all/")
	for k, s := range one {
		if all[k] != s {
			t.Errorf("after ReleaseAll %q is %s; after Release %s", k, all[k], s)
		}
	}
	if len(one) != len(all) {
		t.Errorf("after Release %d keys, after ReleaseAll %d", len(one), len(all))
	}
	for _, k := range []string{"held", "again", "forced", "expired", "last"} {
		if i, _ := info(t, b, "all/"+k); i.Held {
			t.Errorf("after ReleaseAll %q is still held: %+v", k, i)
		}
	}
	if i, _ := info(t, b, "all/taken"); !i.Held || i.Owner != "newer" || i.Token != together[4].Token+1 {
		t.Errorf("ReleaseAll touched the newer holder: %+v", i)
	}
	// A repeat (after a lost reply) is harmless: released ones stay nil.
	answers, err = mr.ReleaseAll(ctx(t), ls)
	if err != nil {
		t.Fatalf("repeated ReleaseAll: %v", err)
	}
	for k, i := range order {
		if got, single := answer(answers[k]), answer(b.Release(ctx(t), singles[i])); got != single {
			t.Errorf("repeated ReleaseAll answer %d (%q) = %s, a repeated Release %s", k, ls[k].Key, got, single)
		}
	}
}

// ReleaseAll by the owner inside its lease's min hold answers nil and
// leaves the key held by that owner with the same token until grant +
// MinHold, as Release does; a lease of the same call without one is
// released at once.
func testReleaseAllMinHold(t *testing.T, h Harness) {
	if h.NoMinHold {
		t.Skip("backend keeps no min hold")
	}
	b := h.New(t)
	mr := multiReleaser(t, b)
	kept := acquireMinHold(t, b, "kept", "o", minHold)
	free := acquire(t, b, "free", "o")
	answers, err := mr.ReleaseAll(ctx(t), []sqllock.Lease{kept, free})
	if err != nil || len(answers) != 2 || answers[0] != nil || answers[1] != nil {
		t.Fatalf("ReleaseAll = %v, %v; want two nil answers", answers, err)
	}
	checkHeldUntil(t, b, kept, "o", "after ReleaseAll inside the min hold")
	if i, _ := info(t, b, "free"); i.Held {
		t.Errorf("the lease without a min hold is still held: %+v", i)
	}
	answers, err = mr.ReleaseAll(ctx(t), []sqllock.Lease{free, kept})
	if err != nil || len(answers) != 2 || answers[0] != nil || answers[1] != nil {
		t.Fatalf("repeated ReleaseAll = %v, %v; want two nil answers", answers, err)
	}
	checkHeldUntil(t, b, kept, "o", "after a repeated ReleaseAll")
}

// ReleaseAllBadInputs is the table of release sets every
// [sqllock.MultiReleaser] refuses the same way, before any I/O.
func ReleaseAllBadInputs() []BadInput {
	rel := func(ls []sqllock.Lease) func(context.Context, sqllock.Backend) error {
		return func(ctx context.Context, b sqllock.Backend) error {
			answers, err := b.(sqllock.MultiReleaser).ReleaseAll(ctx, ls)
			if err == nil || answers != nil {
				return fmt.Errorf("ReleaseAll(%d leases) = %v, %v; want a refusal without answers", len(ls), answers, err)
			}
			return err
		}
	}
	l := func(key string, token int64, owner string) sqllock.Lease {
		return sqllock.Lease{Key: key, Token: token, Owner: owner}
	}
	k := l("k", 1, "o1") // the lease the rule holds
	many := make([]sqllock.Lease, sqllock.MaxKeysPerAcquire+1)
	for i := range many {
		many[i] = l(fmt.Sprintf("k%03d", i), 1, "o1")
	}
	many[0] = k
	return []BadInput{
		{"ReleaseAllNone", rel(nil), sqllock.ErrInvalidKey},
		{"ReleaseAllEmpty", rel([]sqllock.Lease{}), sqllock.ErrInvalidKey},
		{"ReleaseAllTooMany", rel(many), sqllock.ErrInvalidKey},
		{"ReleaseAllKeyTwice", rel([]sqllock.Lease{k, l("a", 1, "o1"), k}), sqllock.ErrInvalidKey},
		{"ReleaseAllKeyTwiceTokens", rel([]sqllock.Lease{k, l("k", 2, "o1")}), sqllock.ErrInvalidKey},
		{"ReleaseAllEmptyKey", rel([]sqllock.Lease{k, l("", 1, "o1")}), sqllock.ErrInvalidKey},
		{"ReleaseAllKeyNUL", rel([]sqllock.Lease{k, l("b\x00", 1, "o1")}), sqllock.ErrInvalidKey},
		{"ReleaseAllPermitKey", rel([]sqllock.Lease{k, l(sqllock.PermitKey("pool", 1), 1, "o1")}), sqllock.ErrInvalidKey},
		{"ReleaseAllReaderSlot", rel([]sqllock.Lease{k, l(sqllock.SharedKey("doc", 1), 1, "o1")}), sqllock.ErrInvalidKey},
		{"ReleaseAllTokenZero", rel([]sqllock.Lease{k, l("a", 0, "o1")}), sqllock.ErrInvalidToken},
		{"ReleaseAllTokenNegative", rel([]sqllock.Lease{k, l("a", -1, "o1")}), sqllock.ErrInvalidToken},
		{"ReleaseAllNoOwner", rel([]sqllock.Lease{k, l("a", 1, "")}), sqllock.ErrInvalidOwner},
		{"ReleaseAllMixedOwners", rel([]sqllock.Lease{k, l("a", 1, "o2")}), sqllock.ErrInvalidOwner},
	}
}

func testReleaseAllBadInput(t *testing.T, h Harness) {
	b := h.New(t)
	multiReleaser(t, b)
	l := acquire(t, b, "k", "o1")
	if l.Token != 1 {
		t.Fatalf("first grant of k has token %d, want 1", l.Token)
	}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	for _, in := range ReleaseAllBadInputs() {
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

// ReleaseAll with a context that has ended sends nothing: an error and
// no answers, every lease still held.
func testReleaseAllNotSent(t *testing.T, h Harness) {
	b := h.New(t)
	mr := multiReleaser(t, b)
	ls := []sqllock.Lease{acquire(t, b, "a", "o"), acquire(t, b, "b", "o")}
	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	answers, err := mr.ReleaseAll(cancelled, ls)
	if err == nil || answers != nil {
		t.Fatalf("ReleaseAll with an ended context = %v, %v; want an error and no answers", answers, err)
	}
	for _, l := range ls {
		if i, _ := info(t, b, l.Key); !i.Held || i.Token != l.Token || i.Owner != "o" {
			t.Errorf("ReleaseAll not sent, yet %q is %+v", l.Key, i)
		}
	}
}
