// Command sqllock applies ashlock's schema, runs a command under a
// distributed lock, lists and releases locks, and load-tests a lock table.
// See "sqllock --help" and package internal/cli.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/ashlock/ashlock/internal/cli"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := cli.Run(ctx, os.Args[1:], os.Stdin, os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}
