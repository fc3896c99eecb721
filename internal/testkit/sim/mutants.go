package sim

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
)

// The deliberately broken database behaviours the checker-sensitivity test
// (SIM-3) switches on through Config.Mutant. They wrap the memory backend
// here, in the simulation, so that no user build contains them. (The
// client's own mutants live in sqllock, compiled only with the
// sqllock_mutants build tag.)
const (
	// MutantRenewIgnoresToken renews whatever lease holds the key, held
	// and unexpired, whatever the renewing lease's token.
	MutantRenewIgnoresToken = "renew-ignores-token"
	// MutantReleaseDeletesRow forgets the key on release, so its tokens
	// restart at 1.
	MutantReleaseDeletesRow = "release-deletes-row"
)

// BackendMutants lists the mutants Config.Mutant takes.
var BackendMutants = []string{MutantRenewIgnoresToken, MutantReleaseDeletesRow}

// mutantDB is the memory backend with one mutant switched on.
type mutantDB struct {
	*memory.Backend
	mutant string
}

func newMutantDB(mem *memory.Backend, mutant string) *mutantDB {
	switch mutant {
	case MutantRenewIgnoresToken, MutantReleaseDeletesRow, MutantPermitsPlusOne, MutantReapForgetsFloor:
	default:
		panic(fmt.Sprintf("sim: unknown backend mutant %q", mutant))
	}
	return &mutantDB{Backend: mem, mutant: mutant}
}

func (m *mutantDB) TryRenew(ctx context.Context, l sqllock.Lease, ttl time.Duration) (sqllock.Lease, error) {
	nl, err := m.Backend.TryRenew(ctx, l, ttl)
	var lost *sqllock.LostError
	if m.mutant == MutantRenewIgnoresToken && errors.As(err, &lost) && lost.Reason == sqllock.LostTaken {
		// Renew the newer lease instead, if it is held and unexpired.
		newer := l
		newer.Token = lost.Current
		if nl, err2 := m.Backend.TryRenew(ctx, newer, ttl); err2 == nil {
			return nl, nil
		}
	}
	return nl, err
}

// TryRenewBatch renews each element through TryRenew, so that the mutant
// applies to batches too (the memory backend's own batch renewal would be
// promoted otherwise). The fault wrapper serialises the calls.
func (m *mutantDB) TryRenewBatch(ctx context.Context, reqs []sqllock.RenewRequest) ([]sqllock.RenewResult, error) {
	if err := sqllock.ValidateRenewBatch(reqs); err != nil {
		return nil, err
	}
	out := make([]sqllock.RenewResult, len(reqs))
	for i, r := range reqs {
		out[i].Lease, out[i].Err = m.TryRenew(ctx, r.Lease, r.TTL)
	}
	return out, nil
}

// ReleaseAll releases each lease through Release, so that the mutant
// applies to a set's release too (the memory backend's own would be
// promoted otherwise).
func (m *mutantDB) ReleaseAll(ctx context.Context, ls []sqllock.Lease) ([]error, error) {
	if err := sqllock.ValidateReleaseAll(ls); err != nil {
		return nil, err
	}
	out := make([]error, len(ls))
	for i, l := range ls {
		out[i] = m.Release(ctx, l)
	}
	return out, nil
}

func (m *mutantDB) Release(ctx context.Context, l sqllock.Lease) error {
	if m.mutant != MutantReleaseDeletesRow {
		return m.Backend.Release(ctx, l)
	}
	infos, err := m.Backend.List(ctx, l.Key)
	clears := err == nil && len(infos) > 0 && infos[0].Key == l.Key && infos[0].Held && infos[0].Token == l.Token
	err = m.Backend.Release(ctx, l)
	if clears {
		m.Backend.SetToken(l.Key, 0) // as if the row were deleted: the next grant is token 1
	}
	return err
}
