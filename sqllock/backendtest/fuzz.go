package backendtest

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// Fuzz is the conformance suite's fuzz target for one backend (guarantee
// G7 in the README): for any key, owner and TTL, TryAcquire either refuses the
// request with the validation error sqllock.AcquireRequest.Validate gives,
// leaving no trace, or grants it, and then the key and owner come back
// byte for byte from the lease and from List, and Release ends it. Call it
// from a FuzzXxx function with a backend built for the whole run; the seed
// corpus (tricky keys: the longest, invalid and overlong UTF-8, NUL,
// combining and right-to-left marks, LIKE wildcards, quotes) runs in every
// go test.
func Fuzz(f *testing.F, b sqllock.Backend) {
	seeds := []string{
		"k", "a/b/c", "%", "_", "x%y_z", `back\slash`, "it's", `"quoted"`, "--", "; DROP TABLE x",
		"é", "e\u0301", "\u202eright-to-left", "\ufeffbom", "emoji 🔒", "tab\tnew\nline", " ", "\u00a0",
		strings.Repeat("k", sqllock.MaxKeyLen), strings.Repeat("é", sqllock.MaxKeyLen/2),
		"", "a\x00b", "\xff", "\xc0\x80", "\xed\xa0\x80", strings.Repeat("k", sqllock.MaxKeyLen+1),
	}
	for _, k := range seeds {
		f.Add(k, "owner", int64(time.Minute))
	}
	f.Add("k", "", int64(time.Minute))
	f.Add("k", "o\x00", int64(time.Minute))
	f.Add("k", "ü", int64(sqllock.MinTTL))
	f.Add("k", "o", int64(sqllock.MaxTTL))
	f.Add("k", "o", int64(sqllock.MinTTL-1))
	f.Add("k", "o", int64(0))
	f.Add("k", "o", int64(-1))
	f.Fuzz(func(t *testing.T, key, owner string, ttl int64) {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		req := sqllock.AcquireRequest{Key: key, Owner: owner, TTL: time.Duration(ttl)}
		invalid := req.Validate()
		before := count(ctx, t, b)
		l, err := b.TryAcquire(ctx, req)
		if invalid != nil {
			for _, sentinel := range []error{sqllock.ErrInvalidKey, sqllock.ErrInvalidOwner, sqllock.ErrInvalidTTL} {
				if errors.Is(invalid, sentinel) && !errors.Is(err, sentinel) {
					t.Fatalf("TryAcquire(%q, %q, %v) = %v, want %v (%v)", key, owner, req.TTL, err, sentinel, invalid)
				}
			}
			if after := count(ctx, t, b); after != before {
				t.Fatalf("a refused request left a trace: %d keys before, %d after", before, after)
			}
			return
		}
		if err != nil {
			t.Fatalf("TryAcquire(%q, %q, %v): %v", key, owner, req.TTL, err)
		}
		if l.Key != key || l.Owner != owner {
			t.Fatalf("lease key %q owner %q, want %q %q", l.Key, l.Owner, key, owner)
		}
		all, err := b.List(ctx, key)
		if err != nil {
			t.Fatalf("List(%q): %v", key, err)
		}
		found := false
		for _, i := range all {
			if !strings.HasPrefix(i.Key, key) {
				t.Fatalf("List(%q) returned %q", key, i.Key)
			}
			if i.Key == key {
				found = true
				// A lease of a few milliseconds may be over already.
				if i.Owner != owner || i.Token != l.Token || (!i.Held && req.TTL >= time.Second) {
					t.Fatalf("List(%q) = %+v, want owner %q, token %d, held", key, i, owner, l.Token)
				}
			}
		}
		if !found {
			t.Fatalf("List(%q) does not return the key", key)
		}
		if err := b.Release(ctx, l); err != nil && !(errors.Is(err, sqllock.ErrLeaseLost) && req.TTL < time.Second) {
			t.Fatalf("Release(%q): %v", key, err)
		}
	})
}

func count(ctx context.Context, t *testing.T, b sqllock.Backend) int {
	t.Helper()
	all, err := b.List(ctx, "")
	if err != nil {
		t.Fatalf("List: %v", err)
	}
	return len(all)
}
