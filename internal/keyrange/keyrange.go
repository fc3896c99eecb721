// Package keyrange turns a key prefix into the half-open range of keys a
// SQL dialect's List scans (key >= prefix AND key < end), so that the scan
// uses the primary key's index whatever the collation of LIKE.
package keyrange

// PrefixEnd returns the smallest string greater than every string that
// starts with prefix, and false when there is none (prefix empty or all
// 0xff bytes; valid UTF-8 never contains 0xff): the scan then has no upper
// bound.
func PrefixEnd(prefix string) (string, bool) {
	b := []byte(prefix)
	for i := len(b) - 1; i >= 0; i-- {
		if b[i] < 0xff {
			b[i]++
			return string(b[:i+1]), true
		}
	}
	return "", false
}
