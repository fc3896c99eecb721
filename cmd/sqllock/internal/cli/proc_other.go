//go:build !unix

package cli

import (
	"io"
	"os"
	"os/exec"
	"syscall"
)

// processGroup is the started COMMAND. Without Unix process groups only
// COMMAND itself is signalled, and on Windows every signal kills it.
type processGroup struct {
	p *os.Process
}

func prepareGroup(cmd *exec.Cmd, stdin io.Reader) *processGroup { return &processGroup{} }

func (pg *processGroup) started(p *os.Process) { pg.p = p }

func (pg *processGroup) signal(sig syscall.Signal) error {
	if sig == syscall.SIGKILL {
		return pg.p.Kill()
	}
	return pg.p.Signal(sig)
}

func (pg *processGroup) alive() bool { return false }

func (pg *processGroup) restoreTerminal() {}

func waitSignaled(ps *os.ProcessState) (syscall.Signal, bool) { return 0, false }
