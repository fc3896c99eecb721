package memory

import (
	"context"
	"sort"
	"strings"
	"time"

	"github.com/ashlock/ashlock/sqllock"
)

// Reap implements [sqllock.Reaper]: it deletes up to limit keys, in key
// order, whose deadline is at or before now - olderThan, and raises the
// floor to the largest token it deleted, under the one mutex every other
// operation takes, so no acquire can see the key gone and the floor not yet
// raised.
func (b *Backend) Reap(ctx context.Context, olderThan time.Duration, limit int) (int, error) {
	if err := sqllock.ValidateReap(olderThan, limit); err != nil {
		return 0, err
	}
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	cutoff := b.now().Add(-olderThan)
	var gone []string
	for k, e := range b.keys {
		if !e.deadline.After(cutoff) && !strings.Contains(k, "#permit") && !readerSlot(k) {
			gone = append(gone, k)
		}
	}
	sort.Strings(gone)
	if len(gone) > limit {
		gone = gone[:limit]
	}
	for _, k := range gone {
		b.floor = max(b.floor, b.keys[k].token)
		delete(b.keys, k)
	}
	return len(gone), nil
}

// readerSlot reports whether k is a key's reader slot, which a reap
// leaves alone: the slots' numbering is their key's own.
func readerSlot(k string) bool {
	_, _, ok := sqllock.ParseSharedKey(k)
	return ok
}
