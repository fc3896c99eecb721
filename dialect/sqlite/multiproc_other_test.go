//go:build !unix

package sqlite

const helperEnv = "ASHLOCK_SQLITE_HELPER"

func helperMain() int { return 2 }
