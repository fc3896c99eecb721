//go:build !race

package sqllock_test

const raceEnabled = false
