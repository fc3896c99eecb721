package main

import (
	"math"
	"math/bits"
	"slices"
	"time"
)

// hist is a log-linear latency histogram: 64 power-of-two ranges, each cut
// into 128 linear sub-buckets, so a quantile is exact to within 1%. One per
// worker (no locking), merged after a cell.
type hist struct {
	b [64][128]uint64
	n uint64
}

func (h *hist) add(d time.Duration) {
	v := uint64(max(d, 1))
	e := bits.Len64(v) // v in [2^(e-1), 2^e)
	var sub uint64
	if e > 7 {
		sub = (v >> (e - 8)) & 127
	} else {
		sub = v & 127
	}
	h.b[e-1][sub]++
	h.n++
}

func (h *hist) merge(o *hist) {
	for i := range h.b {
		for j := range h.b[i] {
			h.b[i][j] += o.b[i][j]
		}
	}
	h.n += o.n
}

// quantile returns the q-quantile (0 < q <= 1), the middle of its bucket.
func (h *hist) quantile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	target := uint64(math.Ceil(q * float64(h.n)))
	var cum uint64
	for e := range h.b {
		for sub := range h.b[e] {
			cum += h.b[e][sub]
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

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	n := len(s)
	if n%2 == 1 {
		return s[n/2]
	}
	return (s[n/2-1] + s[n/2]) / 2
}

// durQuantile returns the q-quantile of ds (nearest rank).
func durQuantile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return s[min(max(i, 0), len(s)-1)]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }
