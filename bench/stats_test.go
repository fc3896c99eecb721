package main

import (
	"testing"
	"time"
)

func TestHistQuantile(t *testing.T) {
	var h hist
	for i := 1; i <= 1000; i++ {
		h.add(time.Duration(i) * time.Microsecond)
	}
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 500 * time.Microsecond}, {0.99, 990 * time.Microsecond}, {1, 1000 * time.Microsecond}} {
		got := h.quantile(c.q)
		if diff := float64(got-c.want) / float64(c.want); diff > 0.01 || diff < -0.01 {
			t.Errorf("quantile(%v) = %v, want %v ±1%%", c.q, got, c.want)
		}
	}
	var small hist
	small.add(3)
	if got := small.quantile(0.5); got != 3 {
		t.Errorf("small: %v", got)
	}
}
