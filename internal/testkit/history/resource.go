package history

import "sync"

// Resource is the protected resource of the fenced-write checks: a counter
// per key that applies an access only when its token is at least the
// highest token it has seen (G4). A read registers its token too, so a
// read-modify-write by a holder fences out every older holder from the
// moment the newer one has read. It is safe for concurrent use.
type Resource struct {
	rec *Recorder

	mu   sync.Mutex // guards keys
	keys map[string]*fenced
}

type fenced struct{ highest, value int64 }

// NewResource returns an empty resource that records every access in rec.
func NewResource(rec *Recorder) *Resource {
	return &Resource{rec: rec, keys: map[string]*fenced{}}
}

func (r *Resource) get(key string) *fenced {
	f := r.keys[key]
	if f == nil {
		f = &fenced{}
		r.keys[key] = f
	}
	return f
}

// Read returns key's value if token is not stale. a carries the caller's
// identity (Client, Guard, GuardValid, Zombie).
func (r *Resource) Read(key string, token int64, a Access) (int64, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f := r.get(key)
	a.Key, a.Token, a.Write, a.At = key, token, false, r.rec.Now()
	a.Accepted = token >= f.highest
	if a.Accepted {
		f.highest = token
		a.Value = f.value
	}
	r.rec.Access(a)
	return a.Value, a.Accepted
}

// Write sets key's value to v if token is not stale.
func (r *Resource) Write(key string, token, v int64, a Access) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	f := r.get(key)
	a.Key, a.Token, a.Write, a.At, a.Value = key, token, true, r.rec.Now(), v
	a.Accepted = token >= f.highest
	if a.Accepted {
		f.highest, f.value = token, v
	}
	r.rec.Access(a)
	return a.Accepted
}

// Finish records every key's final value in the history.
func (r *Resource) Finish() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for k, f := range r.keys {
		r.rec.SetFinal(k, f.value)
	}
}
