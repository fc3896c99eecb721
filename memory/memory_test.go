package memory_test

import (
	"testing"

	"go.uber.org/goleak"

	"github.com/ashlock/ashlock/memory"
	"github.com/ashlock/ashlock/sqllock"
	"github.com/ashlock/ashlock/sqllock/backendtest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestConformance(t *testing.T) {
	t.Parallel()
	backendtest.Run(t, backendtest.Harness{
		New: func(t *testing.T) sqllock.Backend { return memory.New() },
		Expire: func(t *testing.T, b sqllock.Backend, key string) {
			b.(*memory.Backend).Expire(key)
		},
		SetToken: func(t *testing.T, b sqllock.Backend, key string, token int64) {
			b.(*memory.Backend).SetToken(key, token)
		},
		Shared: true,
	})
}

func FuzzMemory(f *testing.F) { backendtest.Fuzz(f, memory.New()) }
