package etcd

import (
	"context"
	"encoding/json"
	"slices"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/ashlock/ashlock/internal/outcome"
	"github.com/ashlock/ashlock/sqllock"
)

var _ sqllock.MultiReleaser = (*Backend)(nil)

// ReleaseAll implements [sqllock.MultiReleaser] with one transaction of
// nested ones, one per lease in key order: each the flat release a single
// Release sends first (the holder's delete and the release record, iff
// the lease holds its key and no min-hold key is there), so that each
// lease gets its own answer. A lease whose nested transaction did not
// hold changed nothing and is released alone afterwards, with Release
// itself, which gives Release's answer; so is one this Backend granted
// with a min hold, whose release is never flat. Within
// [Options.MaxTxnOps]: the set goes in as many transactions as its
// nested ones need (one for a set of up to MaxTxnOps/2 keys). A
// transaction whose reply was lost gives its leases Release's answer to a
// lost reply; one etcd refused applied nothing, and its leases are
// released alone.
func (b *Backend) ReleaseAll(ctx context.Context, ls []sqllock.Lease) ([]error, error) {
	if err := sqllock.ValidateReleaseAll(ls); err != nil {
		return nil, err
	}
	if err := ctx.Err(); err != nil {
		return nil, notSent(outcome.Release, ls[0].Key, err)
	}
	order := make([]int, len(ls))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(i, j int) int { return strings.Compare(ls[i].Key, ls[j].Key) })
	out := make([]error, len(ls))
	alone := make([]bool, len(ls))
	seen := make([]seenRecord, len(ls))
	var flat []int
	for _, i := range order {
		seen[i] = b.recall(ls[i].Key)
		if seen[i].token == ls[i].Token && seen[i].holdLease != 0 {
			alone[i] = true
			continue
		}
		flat = append(flat, i)
	}
	per := max(1, b.rel.MaxMembers) // as many as a batch of releases
	for len(flat) > 0 {
		n := min(per, len(flat))
		chunk := flat[:n]
		flat = flat[n:]
		ops := make([]clientv3.Op, len(chunk))
		for k, i := range chunk {
			rel, err := json.Marshal(releaseRec(ls[i], seen[i]))
			if err != nil {
				return nil, err
			}
			ops[k] = b.releaseOp(ls[i], string(rel))
		}
		resp, err := b.cli.Txn(ctx).Then(ops...).Commit()
		for k, i := range chunk {
			switch {
			case err != nil && mayHaveApplied(err):
				out[i] = translate(ctx, outcome.Release, ls[i].Key, err)
			case err != nil:
				alone[i] = true // nothing applied
			default:
				tr := resp.Responses[k].GetResponseTxn()
				if !tr.GetSucceeded() {
					alone[i] = true // changed nothing
					continue
				}
				b.released(ls[i], seen[i], tr.Responses[0].GetResponseDeleteRange().GetPrevKvs())
			}
		}
	}
	for _, i := range order {
		if alone[i] {
			out[i] = b.Release(ctx, ls[i])
		}
	}
	return out, nil
}
