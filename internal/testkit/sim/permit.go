package sim

import (
	"context"
	"fmt"

	"github.com/ashlock/ashlock/internal/testkit/history"
	"github.com/ashlock/ashlock/sqllock"
)

// The semaphore simulation (Config.Permits): every key k0, k1 ... is a
// semaphore of Config.Permits permits. A session takes one permit with
// Client.AcquirePermit (waiting as a single-key session waits) and fences
// its read-modify-writes on the permit's own key with the permit's token:
// each permit is a fenced resource of its own. C-PERMITS counts the
// holders of each semaphore by the database clock; the single-key
// checkers hold per permit.

// permitParams are the checkers' parameters for a semaphore run of cfg
// over nKeys keys: the limit of each, and no C-LIVE, whose waits are per
// key (a waiter of a semaphore waits for any of its permits), nor
// TokenStep1 (a semaphore's permits are created with token 1, so a
// permit's first grant is token 2).
func permitParams(p history.Params, cfg Config, nKeys int) history.Params {
	p.Permits = map[string]int{}
	for i := range nKeys {
		p.Permits[keyName(i)] = cfg.Permits
	}
	p.NoLiveness, p.TokenStep1 = true, false
	return p
}

func keyName(i int) string { return fmt.Sprintf("k%d", i) }

// acquire takes p's key, or a permit of it.
func (w *world) acquire(cl *client, p plan) (*sqllock.Guard, error) {
	opts := &sqllock.AcquireOptions{TTL: cl.ttl, Wait: p.wait}
	if w.cfg.Permits == 0 {
		return cl.c.Acquire(cl.ctx, p.key, opts)
	}
	return cl.c.AcquirePermit(cl.ctx, p.key, w.cfg.Permits, opts)
}

// expiring is the key an Expire fault of key hits: the key, or one of its
// permits.
func (w *world) expiring(key string) string {
	if w.cfg.Permits == 0 {
		return key
	}
	return sqllock.PermitKey(key, 1+w.rng.IntN(w.cfg.Permits))
}

// MutantPermitsPlusOne makes the backend keep every semaphore with one
// permit more than asked (C-PERMITS must see N+1 holders).
const MutantPermitsPlusOne = "permits-plus-one"

// TryAcquirePermit implements sqllock.PermitAcquirer, one permit too many
// with MutantPermitsPlusOne.
func (m *mutantDB) TryAcquirePermit(ctx context.Context, req sqllock.PermitRequest) (sqllock.Lease, error) {
	if m.mutant == MutantPermitsPlusOne {
		req.Permits++
	}
	return m.Backend.TryAcquirePermit(ctx, req)
}
