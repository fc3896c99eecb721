// Command sqllock applies ashlock's schema, runs a command under a
// distributed lock, lists and releases locks, and load-tests a lock table.
// See "sqllock --help" and package internal/cli.
package main

import "github.com/ashlock/ashlock/internal/cli"

func main() { cli.Main() }
