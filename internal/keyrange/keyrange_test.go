package keyrange

import "testing"

func TestPrefixEnd(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{"": "", "a": "b", "job/": "job0", "a\xff": "b", "é": "\xc3\xaa"} {
		got, ok := PrefixEnd(in)
		if ok != (in != "") || got != want {
			t.Errorf("PrefixEnd(%q) = %q, %v; want %q, %v", in, got, ok, want, in != "")
		}
	}
	if _, ok := PrefixEnd("\xff\xff"); ok {
		t.Errorf("PrefixEnd(\"\\xff\\xff\") has an end")
	}
}
