package mariadb

// Watch implements [sqllock.Watcher] for releases made through this
// Backend. MariaDB has no LISTEN/NOTIFY: waiters in other processes learn
// of a release at their next poll (the client always polls), which costs
// them time, never safety.
func (b *Backend) Watch(key string) (<-chan struct{}, func()) { return b.signals.Watch(key) }
