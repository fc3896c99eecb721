package sqllock_test

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

// TestKeyStateLoss: the one classification of a lost lease that every
// backend uses.
func TestKeyStateLoss(t *testing.T) {
	l := sqllock.Lease{Key: "k", Token: 5, Owner: "me"}
	for _, tc := range []struct {
		name   string
		s      sqllock.KeyState
		reason sqllock.LostReason // 0 with ok: valid
		ok     bool
		by     string
	}{
		{"valid", sqllock.KeyState{Found: true, Token: 5, Held: true, Owner: "me"}, 0, true, ""},
		{"no row", sqllock.KeyState{}, sqllock.LostReleased, false, ""},
		{"token never reached", sqllock.KeyState{Found: true, Token: 4, Held: true}, sqllock.LostReleased, false, ""},
		{"taken", sqllock.KeyState{Found: true, Token: 6, Held: true, Owner: "other"}, sqllock.LostTaken, false, ""},
		{"released by another", sqllock.KeyState{Found: true, Token: 5, Owner: "admin"}, sqllock.LostReleased, false, "admin"},
		{"expired", sqllock.KeyState{Found: true, Token: 5, Held: true, Expired: true, Owner: "me"}, sqllock.LostExpired, false, ""},
	} {
		lost := tc.s.Loss(l)
		if tc.ok {
			if lost != nil {
				t.Errorf("%s: Loss = %v, want nil", tc.name, lost)
			}
			continue
		}
		if lost == nil || lost.Reason != tc.reason || lost.By != tc.by || lost.Key != "k" || lost.Token != 5 {
			t.Errorf("%s: Loss = %+v, want reason %v by %q", tc.name, lost, tc.reason, tc.by)
		}
		if tc.reason == sqllock.LostTaken && lost.Current != 6 {
			t.Errorf("%s: Current = %d, want 6", tc.name, lost.Current)
		}
	}
	if !(sqllock.KeyState{Found: true, Token: 5, Owner: "me"}).ReleasedByOwner(l) {
		t.Error("a lease released by its owner is released by its owner")
	}
	for _, s := range []sqllock.KeyState{{Found: true, Token: 5, Owner: "admin"}, {Found: true, Token: 5, Held: true, Owner: "me"}, {Found: true, Token: 6, Owner: "me"}} {
		if s.ReleasedByOwner(l) {
			t.Errorf("%+v is not a release by l's owner", s)
		}
	}
}

// Timings that are not TTLs are refused with their own sentinel (and, as
// before it existed, ErrInvalidTTL), naming the option.
func TestNonTTLTimingsHaveTheirOwnError(t *testing.T) {
	mem := memory.New()
	_, err := sqllock.New(mem, sqllock.Options{ReleaseTimeout: -time.Second})
	var oe *sqllock.OptionError
	if !errors.As(err, &oe) || oe.Field != "ReleaseTimeout" || !errors.Is(err, sqllock.ErrInvalidOption) || !errors.Is(err, sqllock.ErrInvalidTTL) {
		t.Errorf("negative ReleaseTimeout: %v", err)
	}
	c, err := sqllock.New(mem, sqllock.Options{})
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.TryAcquire(t.Context(), "k", &sqllock.AcquireOptions{Wait: -time.Second})
	if !errors.As(err, &oe) || oe.Field != "AcquireOptions.Wait" || !errors.Is(err, sqllock.ErrInvalidOption) {
		t.Errorf("negative Wait: %v", err)
	}
	if strings.Contains(err.Error(), "nanoseconds") {
		t.Errorf("the bare-number hint is for positive values only: %v", err)
	}
}

// TestLostUnreachableSaysWhatTheClientKnows: a lease lost at its local
// deadline is reported as what the client knows, that no renewal
// succeeded in time, not as an outage it did not see: a paused process
// never sent a renewal, and the last error is nil then.
func TestLostUnreachableSaysWhatTheClientKnows(t *testing.T) {
	paused := &sqllock.LostError{Key: "k", Token: 3, Reason: sqllock.LostUnreachable}
	if got, want := paused.Error(), `sqllock: lease lost: "k" token 3 not renewed before the local deadline`; got != want {
		t.Errorf("Error() = %q, want %q", got, want)
	}
	if strings.Contains(paused.Error(), "unreachable") {
		t.Errorf("Error() = %q claims an unreachable backend", paused.Error())
	}
	if got := sqllock.LostUnreachable.Name(); got != "unreachable" {
		t.Errorf("Name() = %q: the stable label changed", got)
	}
}
