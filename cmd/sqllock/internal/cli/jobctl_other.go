//go:build !linux

package cli

// proxyStops is Linux only; elsewhere Ctrl-Z stops COMMAND alone.
func (pg *processGroup) proxyStops() func() { return func() {} }
