package sqllock

import "context"

// parentWatch ends the Guards acquired under contexts that share one Done
// channel when that channel closes: one context.AfterFunc for all of them,
// instead of one per Guard (its context, its callback and its stop func:
// three allocations per acquire under a context that can end).
//
// When its last Guard goes, a watch is kept, idle, for the next Guard under
// the same context (a loop of acquire and release under one request or
// worker context then registers nothing); the Client keeps at most one
// idle watch, so that contexts that never end (a context.WithCancel whose
// cancel is never called) are not kept alive one per acquire.
type parentWatch struct {
	done   <-chan struct{}
	stop   func() bool
	guards map[*Guard]struct{}
}

// watchParent makes g end when its acquire context ends (parentEnded), if
// that context can end. It runs after g is scheduled; a Guard already
// released (by Close) is not watched.
func (c *Client) watchParent(g *Guard) {
	done := g.parent.Done()
	if done == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed || !c.linked(g) {
		return // released by Close, or about to be
	}
	w := c.watches[done]
	if w == nil {
		w = &parentWatch{done: done, guards: make(map[*Guard]struct{}, 1)}
		// If the context has already ended, the func runs at once, in
		// a goroutine of its own: after this lock is released.
		w.stop = context.AfterFunc(g.parent, func() { c.parentDone(w) })
		if c.watches == nil {
			c.watches = make(map[<-chan struct{}]*parentWatch)
		}
		c.watches[done] = w
	}
	if c.idle == w {
		c.idle = nil
	}
	w.guards[g] = struct{}{}
	g.link.watch = w
}

// unwatchParent stops watching g's acquire context: g was released or
// lost. A watch left with no Guard becomes the idle one, and the previous
// idle watch is stopped.
func (c *Client) unwatchParent(g *Guard) {
	var stop func() bool
	c.mu.Lock()
	if w := g.link.watch; w != nil {
		g.link.watch = nil
		delete(w.guards, g)
		if len(w.guards) == 0 && c.watches[w.done] == w {
			if c.idle != nil && c.idle != w {
				delete(c.watches, c.idle.done)
				stop = c.idle.stop
			}
			c.idle = w
		}
	}
	c.mu.Unlock()
	if stop != nil {
		stop()
	}
}

// parentDone runs when a watched context ends: each of its Guards ends, in
// a goroutine of its own (each releases its lease, bounded by
// ReleaseTimeout), as a context.AfterFunc per Guard would run it.
func (c *Client) parentDone(w *parentWatch) {
	c.mu.Lock()
	if c.watches[w.done] == w {
		delete(c.watches, w.done)
	}
	if c.idle == w {
		c.idle = nil
	}
	gs := make([]*Guard, 0, len(w.guards))
	for g := range w.guards {
		gs = append(gs, g)
		g.link.watch = nil
	}
	clear(w.guards)
	c.mu.Unlock()
	for i, g := range gs {
		if i == len(gs)-1 {
			g.parentEnded() // on this goroutine, the AfterFunc's own
			break
		}
		go g.parentEnded()
	}
}

// stopWatches stops every watch: Close calls it once every Guard has been
// released, so that a closed Client leaves nothing registered on its
// callers' contexts.
func (c *Client) stopWatches() {
	c.mu.Lock()
	ws := c.watches
	c.watches, c.idle = nil, nil
	c.mu.Unlock()
	for _, w := range ws {
		w.stop()
	}
}
