package etcd

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ashlock/ashlock/sqllock"
	"github.com/ashlock/ashlock/sqllock/backendtest"
)

func TestConformance(t *testing.T) {
	t.Parallel()
	backendtest.Run(t, backendtest.Harness{
		// A 30 ms min hold is an etcd lease of the server's minimum TTL,
		// which etcd revokes up to about half a second after it expires
		// (its lessor looks for expired leases every 500 ms).
		MinHoldRoundUp: minLeaseTTL(t) + time.Second,
		// A mark's etcd lease likewise.
		MarkRoundUp: minLeaseTTL(t) + time.Second,
		Shared:      true,
		New:         func(t *testing.T) sqllock.Backend { return newBundle(t).backend },
		Expire: func(t *testing.T, b sqllock.Backend, key string) {
			expire(t, b.(*Backend), key)
		},
		SetToken: func(t *testing.T, b sqllock.Backend, key string, token int64) {
			setToken(t, b.(*Backend), key, token)
		},
	})
}

// minLeaseTTL is the TTL the test etcd grants for a 1 s lease: its
// minimum lease TTL (ceil(1.5 × election timeout), 2 s by default).
func minLeaseTTL(t *testing.T) time.Duration {
	cli := newBundle(t).cli
	g, err := cli.Grant(testCtx(t), 1)
	require.NoError(t, err)
	_, err = cli.Revoke(testCtx(t), g.ID)
	require.NoError(t, err)
	return time.Duration(g.TTL) * time.Second
}

func FuzzEtcd(f *testing.F) { backendtest.Fuzz(f, newBundle(f).backend) }
