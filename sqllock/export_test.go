package sqllock

// SchedulerArmed reports whether c's renewal scheduler has its timer set.
func SchedulerArmed(c *Client) bool {
	c.sched.mu.Lock()
	defer c.sched.mu.Unlock()
	return !c.sched.at.IsZero()
}
