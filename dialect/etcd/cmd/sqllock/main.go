// Command sqllock is cmd/sqllock with etcd added: every command but
// migrate also takes an etcd:// (or etcds://, TLS) URL as its
// --database-url, and works on the etcd backend of
// github.com/ashlock/ashlock/dialect/etcd, whose client the root module's
// command does not link:
//
//	go install ./dialect/etcd/cmd/sqllock   # from a clone (docs/releasing.md)
//	sqllock run --database-url etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379 --key nightly -- ./nightly.sh
//	sqllock prune --database-url etcd://10.0.0.1:2379 --older-than 24h
//
// The URL's forms are in etcdDialect's Usage and in docs/etcd.md.
package main

import "github.com/ashlock/ashlock/internal/cli"

func main() { cli.Main(etcdDialect()) }
