//go:build race

package sqllock_test

// raceEnabled: allocation counts are not exact under the race detector
// (sync.Pool drops items at random there).
const raceEnabled = true
