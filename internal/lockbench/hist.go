package lockbench

import (
	"math"
	"math/bits"
	"time"
)

// Hist is a log-linear latency histogram: 64 power-of-two ranges, each cut
// into 128 linear sub-buckets, so a quantile is exact to within 1%. A range
// is allocated when its first latency comes, so that thousands of workers
// (one Hist each, no locking) cost only the ranges their latencies span.
// The zero value is empty and ready to use; a Hist is not safe for
// concurrent use.
type Hist struct {
	b [64]*[128]uint64
	n uint64
}

// Add records d.
func (h *Hist) Add(d time.Duration) {
	v := uint64(max(d, 1))
	e := bits.Len64(v) // v in [2^(e-1), 2^e)
	var sub uint64
	if e > 7 {
		sub = (v >> (e - 8)) & 127
	} else {
		sub = v & 127
	}
	if h.b[e-1] == nil {
		h.b[e-1] = new([128]uint64)
	}
	h.b[e-1][sub]++
	h.n++
}

// Merge adds o's latencies to h.
func (h *Hist) Merge(o *Hist) {
	for i, r := range o.b {
		if r == nil {
			continue
		}
		if h.b[i] == nil {
			h.b[i] = new([128]uint64)
		}
		for j, c := range r {
			h.b[i][j] += c
		}
	}
	h.n += o.n
}

// N is how many latencies h holds.
func (h *Hist) N() uint64 { return h.n }

// Quantile returns the q-quantile (0 < q <= 1), the middle of its bucket;
// 0 when h is empty.
func (h *Hist) Quantile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	target := uint64(math.Ceil(q * float64(h.n)))
	var cum uint64
	for e, r := range h.b {
		if r == nil {
			continue
		}
		for sub, c := range r {
			cum += c
			if cum >= target {
				return bucketMid(e+1, uint64(sub))
			}
		}
	}
	return 0
}

func bucketMid(e int, sub uint64) time.Duration {
	if e <= 7 {
		return time.Duration(sub)
	}
	lo := (uint64(1) << (e - 1)) | sub<<(e-8)
	width := uint64(1) << (e - 8)
	return time.Duration(lo + width/2)
}
