package etcd

import (
	"testing"

	"github.com/ashlock/ashlock/sqllock"
	"github.com/ashlock/ashlock/sqllock/backendtest"
)

func TestConformance(t *testing.T) {
	t.Parallel()
	backendtest.Run(t, backendtest.Harness{
		NoMinHold: true, // not yet: refused, never dropped
		New:       func(t *testing.T) sqllock.Backend { return newBundle(t).backend },
		Expire: func(t *testing.T, b sqllock.Backend, key string) {
			expire(t, b.(*Backend), key)
		},
		SetToken: func(t *testing.T, b sqllock.Backend, key string, token int64) {
			setToken(t, b.(*Backend), key, token)
		},
	})
}

func FuzzEtcd(f *testing.F) { backendtest.Fuzz(f, newBundle(f).backend) }
