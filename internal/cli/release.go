package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/ashlock/ashlock/sqllock"
)

const releaseUsage = `
Usage: sqllock release --key KEY --force [flags]

Ends the current lease on KEY, whoever holds it: for a holder that is stuck
or gone, without waiting for its lease to expire.

It reads KEY's current token, then releases exactly that lease (key and
token), so a newer holder that took KEY in between is never touched; then
it says so and exits 75. The next holder gets a larger fencing token, so a
resource that checks tokens refuses the old holder's late writes: fencing
stays safe. The old holder learns of the loss at its next renewal or at
its release, whichever comes first ("sqllock run" then stops its command,
or reports the loss after it, and exits 76). The release is recorded under
the owner "sqllock release --force by HOST:PID".

Without --force it refuses: this ends another process's lease.

Example:
  sqllock release --key nightly-report --force
`

// releaseFlags are release's flags.
type releaseFlags struct {
	db    dbFlags
	key   string
	force bool
}

func (f *releaseFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.key, "key", "", "the lock's `key` (required)")
	fs.BoolVar(&f.force, "force", false, "really end the lease, whoever holds it")
}

func cmdRelease(ctx context.Context, e *env, args []string) error {
	var f releaseFlags
	if err := e.parseFlags(e.flagSet("release", releaseUsage), &f.db, &f, args); err != nil {
		return err
	}
	key := f.key
	switch {
	case key == "":
		return fail(ExitUsage, "missing --key (see sqllock release --help)")
	case !f.force:
		return fail(ExitUsage, "refusing to release %q without --force: it ends another process's lease, which learns of it only at its next renewal (its fencing token becomes stale); add --force if that is what you want", key)
	}
	if err := sqllock.ValidateKey(key); err != nil {
		return fail(ExitUsage, "--key: %v", err)
	}
	s, err := e.open(ctx, f.db, openOptions{maxConns: 2})
	if err != nil {
		return err
	}
	defer s.close()
	infos, err := s.list(ctx, key, f.db)
	if err != nil {
		return err
	}
	var info *sqllock.LockInfo
	for i := range infos {
		if infos[i].Key == key {
			info = &infos[i]
		}
	}
	switch {
	case info == nil:
		return fail(ExitFailure, "no lock %q in %s (see sqllock list)", key, s.db.display)
	case !info.Held:
		fmt.Fprintf(e.stdout, "%q is not held (token %d, released or expired); nothing to release\n", key, info.Token)
		return nil
	}
	// Token-scoped: this never ends a newer lease granted since the List.
	// Under its own owner, so the holder's later Release reports the loss
	// (and who released) instead of taking it for its own repeat.
	rctx, cancel := s.db.opContext(ctx)
	err = s.backend.Release(rctx, sqllock.Lease{Key: key, Token: info.Token, Owner: forcedOwner()})
	cancel()
	var lost *sqllock.LostError
	switch {
	case err == nil:
	case errors.As(err, &lost) && lost.Reason == sqllock.LostTaken:
		return fail(ExitTempFail, "%q was taken by a newer holder (token %d) after it was read; that lease was left alone (run again to release it)", key, lost.Current)
	case errors.As(err, &lost):
		// Expired or released in between: the key is free either way.
		fmt.Fprintf(e.stdout, "%q (token %d) was already %s; it is free\n", key, info.Token, lost.Reason)
		return nil
	default:
		return s.db.opError(fmt.Errorf("release %q: %w", key, err), f.db)
	}
	fmt.Fprintf(e.stdout, "released %q (token %d, held by %s); the next holder gets a larger token\n", key, info.Token, info.Owner)
	return nil
}

// forcedOwner is the owner a forced release records: who ended the lease.
func forcedOwner() string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "unknown"
	}
	host = strings.ToValidUTF8(strings.ReplaceAll(host, "\x00", ""), "?")
	if len(host) > 200 {
		host = strings.ToValidUTF8(host[:200], "")
	}
	return fmt.Sprintf("sqllock release --force by %s:%d", host, os.Getpid())
}
