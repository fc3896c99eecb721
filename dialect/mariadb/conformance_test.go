package mariadb

import (
	"database/sql"
	"sync"
	"testing"

	"github.com/ashlock/ashlock/sqllock"
	"github.com/ashlock/ashlock/sqllock/backendtest"
)

func TestConformance(t *testing.T) {
	t.Parallel()
	conformance(t, false)
}

// The release of a lease that is not held and unexpired (releaseSQL)
// passes the suite as a release of its own.
func TestConformanceRowRelease(t *testing.T) {
	t.Parallel()
	conformance(t, true)
}

func conformance(t *testing.T, rowRelease bool) {
	var dbs sync.Map // *Backend -> *sql.DB
	backendtest.Run(t, backendtest.Harness{
		New: func(t *testing.T) sqllock.Backend {
			b, db := newBackend(t)
			b.rowRelease = rowRelease
			dbs.Store(b, db)
			return b
		},
		Expire: func(t *testing.T, b sqllock.Backend, key string) {
			expire(t, handle(&dbs, b), b.(*Backend), key)
		},
		SetToken: func(t *testing.T, b sqllock.Backend, key string, token int64) {
			setToken(t, handle(&dbs, b), b.(*Backend), key, token)
		},
	})
}

func handle(dbs *sync.Map, b sqllock.Backend) *sql.DB {
	db, _ := dbs.Load(b)
	return db.(*sql.DB)
}
