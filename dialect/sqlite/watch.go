package sqlite

// Watch implements [sqllock.Watcher] for releases made through this Backend
// (other processes are not seen; their waiters poll).
func (b *Backend) Watch(key string) (<-chan struct{}, func()) { return b.signals.Watch(key) }
