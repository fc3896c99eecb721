// Package faultproxy is a TCP proxy that a test controls, for putting
// network faults between database clients and PostgreSQL: pass, latency,
// blackhole (drop), hold-then-deliver (delayed packets), reset, refuse new
// connections, and blackholing the replies of one connection once a
// request matching a pattern went through it (the reply of a committed
// statement is lost).
//
// Modes apply per direction to every connection, existing and new. Bytes
// are forwarded in order, chunk by chunk: a chunk read from one side is
// queued and a writer per direction delivers, delays, drops or holds it.
// When a side closes, what was queued before the close is still delivered
// (when the mode allows) before the other side is closed, as TCP would.
package faultproxy

import (
	"bytes"
	"net"
	"sync"
	"time"
)

// Mode is what happens to the bytes of one direction.
type Mode int

// The modes.
const (
	// Pass forwards bytes as they come.
	Pass Mode = iota
	// Latency delays every chunk by the latency (plus jitter) after it
	// arrived.
	Latency
	// Blackhole drops bytes; the sockets stay open.
	Blackhole
	// Hold keeps bytes queued and delivers them when the mode changes.
	Hold
)

func (m Mode) String() string {
	switch m {
	case Pass:
		return "pass"
	case Latency:
		return "latency"
	case Blackhole:
		return "blackhole"
	case Hold:
		return "hold"
	}
	return "unknown"
}

// Direction is one way through the proxy.
type Direction int

// The directions.
const (
	Up   Direction = iota // client to server
	Down                  // server to client
)

// Stats are the proxy's counters.
type Stats struct {
	Accepted  int   // connections accepted
	Refused   int   // connections refused (Refuse)
	Resets    int   // connections reset (Reset)
	Open      int   // connections open now
	Queued    int   // bytes queued, not yet delivered or dropped
	Delivered int64 // bytes delivered
	Dropped   int64 // bytes dropped
	Matched   int   // connections whose replies were blackholed by a match
	HalfOpen  int   // connections made half-open by BlackholeOpen
}

// Proxy forwards connections from its address to a target address. It is
// safe for concurrent use.
type Proxy struct {
	ln     net.Listener
	target string

	mu      sync.Mutex // guards everything below; cond waits on it
	cond    *sync.Cond
	mode    [2]Mode
	latency time.Duration
	jitter  time.Duration
	refuse  bool
	pattern []byte // armed match, nil when none
	conns   map[*conn]struct{}
	stats   Stats
	closed  bool
	rngSeed uint64

	wg sync.WaitGroup
}

type chunk struct {
	b   []byte
	at  time.Time
	eof bool
}

type conn struct {
	client, server net.Conn
	queue          [2][]chunk
	blackholeDown  bool // set by a pattern match
	blackholeBoth  bool // set by BlackholeOpen
	done           bool
	tail           []byte // the last bytes sent up, for matches across chunks
}

// New listens on 127.0.0.1 on a free port and forwards to target.
func New(target string) (*Proxy, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	p := &Proxy{ln: ln, target: target, conns: map[*conn]struct{}{}, rngSeed: 0x9e3779b97f4a7c15}
	p.cond = sync.NewCond(&p.mu)
	p.wg.Add(1)
	go p.accept()
	return p, nil
}

// Addr is the proxy's address, host:port.
func (p *Proxy) Addr() string { return p.ln.Addr().String() }

// Stats returns the counters.
func (p *Proxy) Stats() Stats {
	p.mu.Lock()
	defer p.mu.Unlock()
	s := p.stats
	s.Open, s.Queued = len(p.conns), 0
	for c := range p.conns {
		for d := range c.queue {
			for _, ch := range c.queue[d] {
				s.Queued += len(ch.b)
			}
		}
	}
	return s
}

// Set sets the mode of both directions.
func (p *Proxy) Set(m Mode) { p.SetDir(Up, m); p.SetDir(Down, m) }

// SetDir sets the mode of one direction.
func (p *Proxy) SetDir(d Direction, m Mode) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.mode[d] = m
	p.cond.Broadcast()
}

// Pass forwards everything again, delivering what Hold kept, and clears a
// match's blackhole and an armed pattern.
func (p *Proxy) Pass() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.mode = [2]Mode{Pass, Pass}
	p.refuse = false
	p.pattern = nil
	for c := range p.conns {
		c.blackholeDown = false
	}
	p.cond.Broadcast()
}

// SetLatency delays every chunk of both directions by d plus up to jitter.
func (p *Proxy) SetLatency(d, jitter time.Duration) {
	p.mu.Lock()
	p.latency, p.jitter = d, jitter
	p.mu.Unlock()
	p.Set(Latency)
}

// Refuse makes the proxy reset new connections at once (true) or accept
// them again (false).
func (p *Proxy) Refuse(on bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.refuse = on
}

// Reset resets every open connection (RST to the client, close to the
// server), dropping what was queued. New connections are accepted.
func (p *Proxy) Reset() {
	p.mu.Lock()
	conns := make([]*conn, 0, len(p.conns))
	for c := range p.conns {
		conns = append(conns, c)
		c.done = true
		p.stats.Resets++
	}
	p.cond.Broadcast()
	p.mu.Unlock()
	for _, c := range conns {
		rst(c.client)
		rst(c.server)
	}
}

// BlackholeRepliesAfter arms a one-shot match: the first connection that
// sends pattern to the server gets its server-to-client bytes dropped from
// then on (until Pass), so the reply to that request, and any later one,
// is lost while the request itself reaches the server.
func (p *Proxy) BlackholeRepliesAfter(pattern []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.pattern = append([]byte(nil), pattern...)
}

// BlackholeOpen makes every connection open now half-open for good: what
// either side sends on it is dropped, and neither side is told (no RST, no
// FIN), as when a NAT or firewall between them drops its state. Connections
// accepted afterwards pass as the modes say. It returns how many
// connections it cut.
func (p *Proxy) BlackholeOpen() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	for c := range p.conns {
		c.blackholeBoth = true
	}
	p.stats.HalfOpen += len(p.conns)
	return len(p.conns)
}

// Close stops accepting, closes every connection and waits for the
// proxy's goroutines.
func (p *Proxy) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	conns := make([]*conn, 0, len(p.conns))
	for c := range p.conns {
		c.done = true
		conns = append(conns, c)
	}
	p.cond.Broadcast()
	p.mu.Unlock()
	err := p.ln.Close()
	for _, c := range conns {
		_ = c.client.Close()
		_ = c.server.Close()
	}
	p.wg.Wait()
	return err
}

func rst(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok {
		_ = tc.SetLinger(0)
	}
	_ = c.Close()
}

func (p *Proxy) accept() {
	defer p.wg.Done()
	for {
		client, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		refuse, closed := p.refuse, p.closed
		if refuse {
			p.stats.Refused++
		}
		p.mu.Unlock()
		if refuse || closed {
			rst(client)
			continue
		}
		server, err := net.DialTimeout("tcp", p.target, 5*time.Second)
		if err != nil {
			rst(client)
			continue
		}
		c := &conn{client: client, server: server}
		p.mu.Lock()
		if p.closed {
			p.mu.Unlock()
			_ = client.Close()
			_ = server.Close()
			continue
		}
		p.conns[c] = struct{}{}
		p.stats.Accepted++
		p.mu.Unlock()
		p.wg.Add(4)
		go p.read(c, Up, client)
		go p.read(c, Down, server)
		go p.write(c, Up, server)
		go p.write(c, Down, client)
	}
}

// read queues what src sends, in chunks, and an EOF marker at the end.
func (p *Proxy) read(c *conn, d Direction, src net.Conn) {
	defer p.wg.Done()
	buf := make([]byte, 32<<10)
	for {
		n, err := src.Read(buf)
		p.mu.Lock()
		if n > 0 {
			b := append([]byte(nil), buf[:n]...)
			if d == Up && p.pattern != nil {
				look := append(append([]byte(nil), c.tail...), b...)
				if bytes.Contains(look, p.pattern) {
					c.blackholeDown = true
					p.pattern = nil
					p.stats.Matched++
				}
				c.tail = look[max(0, len(look)-256):]
			}
			c.queue[d] = append(c.queue[d], chunk{b: b, at: time.Now()})
		}
		if err != nil {
			c.queue[d] = append(c.queue[d], chunk{eof: true, at: time.Now()})
		}
		p.cond.Broadcast()
		p.mu.Unlock()
		if err != nil {
			return
		}
	}
}

// write delivers, delays, drops or holds the queued chunks of one
// direction, in order.
func (p *Proxy) write(c *conn, d Direction, dst net.Conn) {
	defer p.wg.Done()
	defer p.forget(c)
	p.mu.Lock()
	for {
		for !c.done && (len(c.queue[d]) == 0 || p.mode[d] == Hold) {
			p.cond.Wait()
		}
		if c.done {
			p.mu.Unlock()
			_ = dst.Close()
			return
		}
		ch := c.queue[d][0]
		c.queue[d] = c.queue[d][1:]
		mode := p.mode[d]
		if (d == Down && c.blackholeDown) || c.blackholeBoth {
			mode = Blackhole
		}
		wait := time.Duration(0)
		if mode == Latency {
			wait = p.latency + p.jitterLocked() - time.Since(ch.at)
		}
		p.mu.Unlock()
		if ch.eof {
			closeWrite(dst)
			return
		}
		if wait > 0 {
			time.Sleep(wait)
		}
		var err error
		switch mode {
		case Blackhole:
			p.mu.Lock()
			p.stats.Dropped += int64(len(ch.b))
			p.mu.Unlock()
		default:
			_, err = dst.Write(ch.b)
			p.mu.Lock()
			p.stats.Delivered += int64(len(ch.b))
			p.mu.Unlock()
		}
		p.mu.Lock()
		if err != nil {
			c.done = true
			p.cond.Broadcast()
		}
	}
}

// forget ends c: both sockets are closed once both writers returned.
func (p *Proxy) forget(c *conn) {
	p.mu.Lock()
	defer p.mu.Unlock()
	c.done = true
	p.cond.Broadcast()
	if _, ok := p.conns[c]; ok {
		delete(p.conns, c)
		return
	}
	_ = c.client.Close()
	_ = c.server.Close()
}

func (p *Proxy) jitterLocked() time.Duration {
	if p.jitter <= 0 {
		return 0
	}
	// xorshift: the jitter needs no quality, only spread.
	p.rngSeed ^= p.rngSeed << 13
	p.rngSeed ^= p.rngSeed >> 7
	p.rngSeed ^= p.rngSeed << 17
	return time.Duration(p.rngSeed % uint64(p.jitter))
}

// closeWrite half-closes c (FIN after what was written), or closes it.
func closeWrite(c net.Conn) {
	if tc, ok := c.(*net.TCPConn); ok && tc.CloseWrite() == nil {
		return
	}
	_ = c.Close()
}
