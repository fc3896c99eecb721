package sqllock

// SchedulerArmed reports whether c's renewal scheduler has its timer set.
func SchedulerArmed(c *Client) bool {
	c.sched.mu.Lock()
	defer c.sched.mu.Unlock()
	return !c.sched.at.IsZero()
}

// Watches reports how many acquire contexts c watches, and whether one of
// them is idle (no Guard left).
func Watches(c *Client) (n int, idle bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.watches), c.idle != nil
}

// SetAfterHold makes f run inside the acquire once its Guard is linked
// and scheduled, until the test ends.
func SetAfterHold(t interface{ Cleanup(func()) }, f func(*Client)) {
	afterHold = f
	t.Cleanup(func() { afterHold = nil })
}
