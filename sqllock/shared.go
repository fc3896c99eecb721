package sqllock

import (
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Shared (read) and exclusive (write) locks: the rules every backend that
// grants a shared request keeps (docs/shared-locks.md).
//
// # Layout
//
// A key K held shared has one row (or entry) of its own, K's row, and one
// per shared holder, under the key [SharedKey](K, i) (1 <= i <=
// [MaxShared]): a reader's slot, an ordinary lease with its own token,
// deadline by the backend's clock, owner and value. [Backend.TryRenew],
// [Backend.Release] and [BatchRenewer.TryRenewBatch] take a shared lease
// as any lease; a backend keeps K's row in step (below), so a reader's
// renewal and release stay one statement.
//
// While K is held shared, K's row is held with an empty owner (a value
// [ValidateOwner] refuses, so that no acquire can take it for its own
// retry), its token the key's latest token and its deadline the latest of
// its readers' deadlines. So an exclusive acquire, which grants K only
// when K's row is free, needs to read no other row: it is refused
// beside any reader, as a statement that knows nothing of readers is.
//
// # Rules
//
//   - Tokens come from K's one counter. A shared grant's token is K's
//     token + 1 (also above its slot's previous token), and becomes K's
//     token; an exclusive grant's token is K's token + 1. So an
//     exclusive grant's token is greater than every token granted before
//     it, shared or exclusive, and a shared grant's token is greater than
//     the last exclusive grant's.
//   - A shared request is granted iff K's row is free (as for an
//     exclusive acquire: released, expired, past its min hold) or held
//     shared and unexpired, no writer's mark on K is live, and a slot is
//     free (released, expired, or of an earlier reader epoch).
//   - A shared grant's epoch: the first shared grant on a K that is not
//     held shared starts one, at its token. A shared lease is valid iff
//     its slot is held with its token, unexpired, and K's row is held
//     shared, unexpired, by an epoch that began at or before its token.
//     A forced release of K's row ends every shared lease of the epoch
//     (their renewals report [LostReleased]), as it ends any holder's.
//   - A renewal of a shared lease moves K's deadline to at least the
//     lease's new deadline. A release of the last shared lease of the
//     epoch releases K's row at once, and signals a [Watcher] of K.
//   - A writer's mark: an exclusive request with Mark (the Client sends
//     it from a waiting acquire) that is refused marks K with its owner
//     and a deadline of now + its TTL, unless another writer's mark is
//     live; while a mark is live every shared request is refused (a
//     [*HeldError] with WaitingWriter set), so readers that keep coming
//     never starve a writer. The mark ends at its deadline, or when its
//     writer is granted K. An exclusive request without Mark neither
//     reads nor writes the mark.
//   - No upgrade in place: a shared lease is never turned into an
//     exclusive one. A reader that wants to write releases its shared
//     lease, then acquires exclusive. (Like sync.RWMutex's RLock then
//     Lock, a waiting exclusive acquire by a holder of the same key's
//     shared lease waits for itself until its wait or context ends: the
//     backend cannot tell one holder's goroutines from another's.)
//   - A refused shared request's [*HeldError] names the exclusive holder
//     (Owner), or the number of shared holders (Shared, Owner empty), and
//     the remaining time of what refused it: the exclusive lease, the
//     shared epoch, or the writer's mark.
//   - A backend that does not grant shared requests refuses them before
//     any I/O with an error matching [ErrSharedUnsupported]:
//     [AcquireRequest.Validate] does so.

// MaxShared is the largest number of shared holders a key may have at
// once; a shared request beyond it is refused as held.
const MaxShared = 1024

// sharedInfix makes a reader's slot key (see [SharedKey]).
const sharedInfix = "#shared-"

// SharedKey returns the key of reader slot i of key k: k + "#shared-" + i
// in decimal. A shared Guard's Key is one.
func SharedKey(k string, i int) string { return k + sharedInfix + strconv.Itoa(i) }

// ParseSharedKey reports whether key is a reader slot's key ([SharedKey])
// and if so of which key and which slot.
func ParseSharedKey(key string) (k string, i int, ok bool) {
	at := strings.LastIndex(key, sharedInfix)
	if at <= 0 {
		return "", 0, false
	}
	digits := key[at+len(sharedInfix):]
	if digits == "" || digits[0] < '1' || digits[0] > '9' || len(digits) > 4 {
		return "", 0, false
	}
	n, err := strconv.Atoi(digits)
	if err != nil || n > MaxShared {
		return "", 0, false
	}
	return key[:at], n, true
}

var (
	// ErrSharedUnsupported is returned, before any I/O, by a backend that
	// does not grant shared requests ([AcquireRequest.Shared]), so that a
	// shared request is never silently taken as something else.
	ErrSharedUnsupported = errors.New("sqllock: this backend does not support shared locks")
)

// ValidateShared checks a shared request: as [AcquireRequest.Validate]
// does, but for Shared itself, and that it asks for no min hold
// ([ErrMinHoldUnsupported]) and no Mark, and that its slots' keys fit
// [MaxKeyLen]. Backends that grant shared requests call it first for
// them.
func (r AcquireRequest) ValidateShared() error {
	if !r.Shared {
		return fmt.Errorf("%w: ValidateShared of an exclusive request", ErrInvalidOption)
	}
	r.Shared = false
	if err := r.Validate(); err != nil {
		return err
	}
	if r.Mark {
		return fmt.Errorf("%w: a shared request takes no writer's mark", ErrInvalidOption)
	}
	if n := len(SharedKey(r.Key, MaxShared)); n > MaxKeyLen {
		return fmt.Errorf("%w: the key's reader slots would be %d bytes, more than %d", ErrInvalidKey, n, MaxKeyLen)
	}
	if r.MinHold != 0 {
		return fmt.Errorf("%w: a shared lease takes no min hold", ErrMinHoldUnsupported)
	}
	return nil
}
