package migrations

// LockID exposes the advisory lock id to the external tests.
func LockID(o Options) int64 { return o.lockID() }
