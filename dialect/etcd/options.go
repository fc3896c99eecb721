package etcd

// DefaultPrefix is the etcd key prefix under which a Backend keeps its keys
// when [Options.Prefix] is empty.
const DefaultPrefix = "sqllock/"

// Options configures a [Backend]. The zero value means the defaults.
type Options struct {
	// Prefix is prepended to every etcd key the backend reads or writes
	// (default [DefaultPrefix]). Backends with different prefixes share
	// nothing. It must be valid UTF-8 without NUL, at most 256 bytes.
	Prefix string
	// MaxTxnOps is the most operations the Backend puts in one etcd
	// transaction (default [DefaultMaxTxnOps], etcd's own default); set
	// it to the cluster's --max-txn-ops if that is lower; at least 5,
	// which a release needs. A batch renewal of more leases than fit is
	// split into several transactions.
	MaxTxnOps int
}

// DefaultMaxTxnOps is the most operations a Backend puts in one etcd
// transaction when [Options.MaxTxnOps] is 0: etcd's own default for
// --max-txn-ops.
const DefaultMaxTxnOps = 128

// minTxnOps is the least [Options.MaxTxnOps] accepted: the operations of
// a release's transaction (a state read of 4, and a nested transaction of
// one operation within it), and a batch's nested transaction within one.
const minTxnOps = 5
